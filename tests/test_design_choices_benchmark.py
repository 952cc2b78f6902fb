"""benchmarks/design_choices.py: each choice is timed against its alternative on the same input,
and the two give the same result where they must (a timing of a wrong alternative means nothing)."""
from __future__ import annotations

import subprocess
import sys

from benchmarks.design_choices import STEP_SCRIPT, argmax_rows, decode_attention, sampling_draw
from dabba.config import DEMO_MODEL


def test_each_choice_is_timed_beside_its_alternative() -> None:
    for result in (sampling_draw(1), argmax_rows(1), decode_attention(1)):
        assert result["chosen_ms"] > 0 and result["alternative_ms"] > 0, result
        assert result.get("same_result", True), result


def test_the_engine_thread_script_times_decode_steps_on_either_thread() -> None:
    for where in ("main", "thread"):
        run = subprocess.run([sys.executable, "-c", STEP_SCRIPT.format(model=DEMO_MODEL), where], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert float(run.stdout.strip().splitlines()[-1]) > 0
