"""Loading a real BLAS for MLX: order, opt-out, absence, and same results.

Every case runs in a fresh interpreter, because which BLAS MLX binds to is
fixed, process-wide, the moment mlx.core is imported. Where it matters the
dynamic linker itself is the witness: LD_DEBUG=bindings logs which library
libmlx's `cblas_sgemm` was bound to.
"""

import ctypes
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the BLAS swap is Linux-only"
)


def _have_openblas() -> bool:
    try:
        ctypes.CDLL("libopenblas.so.0")  # RTLD_LOCAL: no effect on this process
    except OSError:
        return False
    return True


needs_openblas = pytest.mark.skipif(
    not _have_openblas(),
    reason="libopenblas.so.0 not found (apt-get install libopenblas0-pthread)",
)


def run_py(*snippets: str, blas_env: str | None = None, ld_debug: bool = False):
    env = {k: v for k, v in os.environ.items() if k not in ("MLXKV_BLAS", "LD_PRELOAD")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if blas_env is not None:
        env["MLXKV_BLAS"] = blas_env
    if ld_debug:
        env["LD_DEBUG"] = "bindings"
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(textwrap.dedent(s) for s in snippets)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def last_json(done) -> dict:
    return json.loads(done.stdout.strip().splitlines()[-1])


def cblas_binding(stderr: str) -> str:
    """The library that libmlx.so's cblas_sgemm was bound to, per ld.so."""
    match = re.search(r"file \S*libmlx\.so \[0\] to (\S+) \[0\]: normal symbol `cblas_sgemm'", stderr)
    assert match, "no cblas_sgemm binding in LD_DEBUG output"
    return match.group(1)


LD_DEBUG_LINE = re.compile(r"^\s*\d+:")  # "  1234:\t..." from ld.so, whatever paths it names


def mlx_notices(stderr: str) -> list[str]:
    """mlxkv's own lines, without the LD_DEBUG noise (which names paths that may contain "mlxkv")."""
    return [line for line in stderr.splitlines() if "mlxkv" in line and not LD_DEBUG_LINE.match(line)]


MATMUL = """
    import mlx.core as mx, numpy as np
    a = mx.random.normal((64, 64)); b = mx.random.normal((64, 64))
    assert np.allclose(np.array(a @ b), np.array(a) @ np.array(b), atol=1e-4)
"""


@needs_openblas
def test_import_mlxkv_first_binds_openblas():
    done = run_py(
        """
        import json, mlxkv
        from mlxkv.system.blas import load_blas, mapped_blas_libraries
    """,
        MATMUL,
        """
        maps = mapped_blas_libraries()
        print(json.dumps({"state": load_blas().state, "maps": maps}))
    """,
        ld_debug=True,
    )
    out = last_json(done)
    assert out["state"] == "loaded"
    assert any("libopenblas" in path for path in out["maps"])
    assert "libopenblas" in cblas_binding(done.stderr)
    assert mlx_notices(done.stderr) == []


@needs_openblas
def test_mlx_core_first_warns_once_with_fix():
    done = run_py(
        """
        import json, warnings
        import mlx.core
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mlxkv
            mlxkv.system.blas.load_blas()
            mlxkv.system.blas.load_blas()
    """,
        MATMUL,
        """
        print(json.dumps({
            "state": mlxkv.system.blas.load_blas().state,
            "messages": [str(w.message) for w in caught],
        }))
    """,
        ld_debug=True,
    )
    out = last_json(done)
    assert out["state"] == "too-late"
    assert len(out["messages"]) == 1
    assert "import mlxkv before" in out["messages"][0]
    assert "LD_PRELOAD" in out["messages"][0]
    # The warning tells the truth: MLX really kept the bundled BLAS.
    assert "mlx_cpu.libs/libblas" in cblas_binding(done.stderr)


def test_opt_out_keeps_bundled_blas_silently():
    done = run_py(
        """
        import json, warnings
        warnings.simplefilter("error")
        import mlxkv
    """,
        MATMUL,
        """
        print(json.dumps({"state": mlxkv.system.blas.load_blas().state}))
    """,
        blas_env="off",
        ld_debug=True,
    )
    assert last_json(done)["state"] == "disabled"
    assert "mlx_cpu.libs/libblas" in cblas_binding(done.stderr)
    assert mlx_notices(done.stderr) == []


def test_missing_blas_works_and_import_prints_nothing():
    done = run_py(
        """
        import json, mlxkv
        from mlxkv.system.blas import load_blas
        load_blas(); load_blas()
    """,
        MATMUL,
        """
        print(json.dumps({"state": load_blas().state}))
    """,
        blas_env="/nonexistent/libnope.so",
    )
    assert last_json(done)["state"] == "missing"
    assert mlx_notices(done.stderr) == []  # a library does not print; it logs


def test_missing_blas_is_logged_once_for_a_program_that_listens():
    done = run_py(
        """
        import logging
        logging.basicConfig(format="%(name)s: %(message)s")
        import mlxkv
        mlxkv.system.blas.load_blas(); mlxkv.system.blas.load_blas()
    """,
        blas_env="/nonexistent/libnope.so",
    )
    notices = mlx_notices(done.stderr)
    assert len(notices) == 1, done.stderr
    assert notices[0].startswith("mlxkv.system.blas: ") and "/nonexistent/libnope.so" in notices[0]


@pytest.mark.slow
def test_the_cli_says_the_blas_is_missing_in_one_line():
    env = {**os.environ, "MLXKV_BLAS": "/nonexistent/libnope.so"}
    done = subprocess.run([sys.executable, "-m", "mlxkv.cli", "doctor"], capture_output=True, text=True, env=env)
    assert done.returncode == 0
    (notice,) = [line for line in done.stderr.splitlines() if line.startswith("mlxkv:")]
    assert notice.startswith("mlxkv: warning: no CBLAS found") and "/nonexistent/libnope.so" in notice


GREEDY = """
    import json, mlxkv
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.llama import Model, ModelArgs

    runs = []
    for seed in (0, 4):  # seeds whose greedy text varies, not one repeated token
        mx.random.seed(seed)
        model = Model(ModelArgs(
            model_type="llama", hidden_size=128, num_hidden_layers=2,
            intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=False,
        ))
        mx.eval(model.parameters())
        prompt = mx.random.randint(0, 512, (12,))
        steps = list(generate_step(prompt, model, max_tokens=16))
        runs.append({"tokens": [int(t) for t, _ in steps],
                     "logprobs": [lp.tolist() for _, lp in steps]})
    print(json.dumps({"state": mlxkv.system.blas.load_blas().state, "runs": runs}))
"""


@pytest.mark.slow
@needs_openblas
def test_greedy_output_identical_with_and_without_real_blas():
    real = last_json(run_py(GREEDY))
    reference = last_json(run_py(GREEDY, blas_env="off"))
    assert (real["state"], reference["state"]) == ("loaded", "disabled")
    for fast, slow in zip(real["runs"], reference["runs"]):
        assert len(fast["tokens"]) == 16 and len(set(fast["tokens"])) > 4
        assert fast["tokens"] == slow["tokens"]
        # Only the summation order differs between the BLASes.
        worst = max(
            abs(a - b)
            for row_a, row_b in zip(fast["logprobs"], slow["logprobs"])
            for a, b in zip(row_a, row_b)
        )
        assert worst < 1e-3


@needs_openblas
def test_doctor_names_the_blas_and_metal():
    done = run_py(
        """
        from mlxkv.system.blas import blas_report, format_doctor
        print(format_doctor(blas_report()))
    """
    )
    text = done.stdout
    assert re.search(r"^blas\s+\S*libopenblas\S* \(real BLAS\)$", text, re.M), text
    assert re.search(r"^metal\s+(not )?available$", text, re.M), text
    assert re.search(r"^mlx\s+\d+\.\d+", text, re.M), text


def test_doctor_reports_reference_blas_when_disabled():
    done = run_py(
        """
        from mlxkv.system.blas import blas_report, format_doctor
        print(format_doctor(blas_report()))
    """,
        blas_env="off",
    )
    assert re.search(r"^blas\s+\S*mlx_cpu.libs/libblas\S* \(reference\)$", done.stdout, re.M)


def test_missing_notice_names_the_install_fix():
    done = run_py(
        """
        import os
        from mlxkv.system import blas
        del os.environ["MLXKV_BLAS"]  # as if unset and nothing was found
        print(blas.slow_blas_notice(blas.BlasStatus(blas.MISSING, None, "no CBLAS found")))
        """,
        blas_env="off",
    )
    notice = done.stdout.strip()
    assert "apt-get install libopenblas0-pthread" in notice
