"""nbval settings: warnings on stderr differ between machines and versions, so never compare them."""


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)
