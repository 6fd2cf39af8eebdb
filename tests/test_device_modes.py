"""The device mode, decided when ``ttx_tutorial`` is imported: the GPU or Triton's interpreter,
chosen without touching the GPU driver, and overridden by the user's own settings."""

import json

from ttx_tutorial.testing import run_python

REPORT_MODE = """
import json, os
import ttx_tutorial, torch
print(json.dumps({
    "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    "interpreted": ttx_tutorial.INTERPRETED,
    "device": str(ttx_tutorial.DEVICE),
    "cuda_initialized": torch.cuda.is_initialized(),
    "describe": ttx_tutorial.describe(),
}))
"""


def test_cpu_mode_turns_on_the_interpreter_without_touching_cuda():
    result = run_python(REPORT_MODE, timeout=120, TTX_TUTORIAL_DEVICE="cpu")
    assert result.returncode == 0, result.stderr
    mode = json.loads(result.stdout)
    assert mode["TRITON_INTERPRET"] == "1"
    assert mode["interpreted"] is True
    assert mode["device"] == "cpu"
    assert mode["cuda_initialized"] is False
    assert mode["describe"].split(" | ")[1].startswith("CPU mode")


def test_an_explicit_triton_interpret_wins_over_the_device_choice():
    result = run_python(REPORT_MODE, timeout=120, TTX_TUTORIAL_DEVICE="cuda", TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    mode = json.loads(result.stdout)
    assert mode["interpreted"] is True and mode["device"] == "cpu"
    assert "TRITON_INTERPRET was set by the user" in mode["describe"]


def test_an_invalid_device_choice_is_a_clear_error():
    result = run_python(REPORT_MODE, timeout=120, TTX_TUTORIAL_DEVICE="tpu")
    assert result.returncode != 0
    assert "ValueError: TTX_TUTORIAL_DEVICE must be one of ('cpu', 'cuda'), got 'tpu'" in result.stderr
