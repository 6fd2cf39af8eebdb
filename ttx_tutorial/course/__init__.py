"""The course's tools, apart from the library: the GPU-compiler probe (:mod:`.compiler`), the
notebook helpers (:mod:`.notebook`), the load/store tracer (:mod:`.trace`) and the GPU figures,
measured live or recorded (:mod:`.figures`). ``import ttx_tutorial`` imports none of them but
:mod:`.notebook`, whose light helpers (``banner``, ``size``) every notebook starts with; the
compiler probe and the tracer reach into Triton's internals and load only when asked for."""
