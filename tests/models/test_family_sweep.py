"""The family sweep: a tiny model of every model module the installed mlx-lm has, served by mlxkv.

For each family mlx-lm runs here (tests/family_sweep.py does the work, in
worker processes, so that a family that crashes MLX takes only its worker):

- greedy tokens equal mlx-lm's, on a prompt and on the chat's next turn, and
  on three more prompts served as one batch (one of a single token);
- the log-probabilities each token was taken from are within a tolerance tied
  to mlx-lm's own spread: how far its log-probabilities move when it prefills
  the same prompt in other chunks (a prefix hit computes the rest apart);
- the next turn is a prefix hit of the whole first turn, to its last full block.

A family is skipped only where mlx-lm itself cannot run it here (its own
error, or its own crash), saying why. A new mlx-lm release shows its new
modules here at once: their tiny config comes from mlxkv/models/tiny_args.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mlxkv.models import compat

WORKER = str(Path(__file__).parents[1] / "family_sweep.py")
MODULES = compat.family_modules()
WORKERS = 2
# Log-probabilities may differ by this many times mlx-lm's own chunking spread, and
# always by float32's noise over a few layers.
SPREAD_FACTOR = 4
FLOOR = 2e-5
# What mlx-lm says where it cannot run a family here: the only reasons to skip.
CANNOT_RUN = ("No Metal back-end", "cannot import it here", "crashes MLX")
CRASH_RETRIES = 3


def _run(modules: list[str], results: dict, args: tuple = ()) -> None:
    """Run a worker over `modules`, restarting it past a module that ends the process."""
    while modules:
        proc = subprocess.run([sys.executable, WORKER, *args, *modules], capture_output=True, text=True,
                              timeout=900)
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue  # a module's own print (olmo's, on import)
            record = json.loads(line)
            if "start" in record:
                started = record["start"]
            else:
                results[record["family"]] = record
                started = None
        if started is None:
            return
        results[started] = {"family": started, "status": "crashed", "returncode": proc.returncode,
                            "stderr": proc.stderr[-2000:]}
        modules = modules[modules.index(started) + 1 :]


@pytest.fixture(scope="module")
def sweep() -> dict:
    results: dict = {}
    parts = [MODULES[i::WORKERS] for i in range(WORKERS)]
    threads = [threading.Thread(target=_run, args=(part, results)) for part in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for module, result in list(results.items()):
        if result["status"] == "crashed":
            results[module] = _crash_verdict(module, result)
    return results


def _crash_verdict(module: str, crash: dict) -> dict:
    """A module that ended its worker: mlx-lm's fault if mlx-lm alone crashes too, else mlxkv's."""
    for _ in range(CRASH_RETRIES):
        alone: dict = {}
        _run([module], alone, ("--oracle-only",))
        if alone.get(module, {}).get("status") == "crashed":
            code = alone[module]["returncode"]
            return {"family": module, "status": "skip",
                    "reason": f"mlx-lm's own run of it crashes MLX's CPU back-end here (exit {code})"}
    return {"family": module, "status": "error",
            "reason": f"mlxkv's run crashed (exit {crash['returncode']}): {crash['stderr'][-300:]}"}


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
def test_every_family_mlx_lm_runs_here_is_served_equal_with_a_prefix_hit(module, sweep):
    result = sweep[module]
    status, reason = result["status"], result.get("reason")
    if status == "helper":
        pytest.skip(reason)
    if status == "skip":
        assert any(why in reason for why in CANNOT_RUN), f"mlx-lm failed on the sweep's tiny config: {reason}"
        pytest.skip(reason)
    assert status == "ok", reason
    assert result["ours"] == result["reference"], f"{module} ({result['layout']}): tokens differ"
    tolerance = max(FLOOR, SPREAD_FACTOR * result["spread"])
    assert result["logprob_diff"] <= tolerance, (module, result["logprob_diff"], result["spread"])
    assert result["hit"] == result["expected_hit"], (module, result["layout"])


@pytest.mark.slow
def test_the_sweep_covers_the_families_the_issue_names(sweep):
    served = {m for m, r in sweep.items() if r["status"] == "ok"}
    named = {"gemma4", "gemma4_text", "deepseek_v32", "glm_moe_dsa", "llama4", "falcon_h1", "mamba", "mamba2",
             "rwkv7", "mimo_v2_flash", "openelm", "baichuan_m1", "longcat_flash", "longcat_flash_ngram",
             "minimax_m3_vl", "deepseek_v41", "nemotron-nas", "afm7", "gemma3n", "plamo3"}
    assert named <= served, named - served
