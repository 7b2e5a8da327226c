"""`mlxkv models list | pull | rm`, the models other tools keep, and `chat` without a terminal."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as T

from gguf_export import write_gguf
from mlxkv.cli import main
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models import fetch
from mlxkv.models.fetch import local_model

OLLAMA_NAME, LMSTUDIO_GGUF = "ollama:tinyllama:latest", "lmstudio:lmstudio-community/TinyLlama-GGUF/tinyllama-Q8_0.gguf"
LMSTUDIO_MLX, HF_ID = "lmstudio:mlx-community/tiny-mlx", "mlx-community/tiny-llama"
PROMPT = [(7 * i + 3) % 400 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def tiny_gguf(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tinyllama.gguf"
    write_gguf(llama_dir, path, "llama", lambda name, w: T.Q8_0)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A temporary home with its own mlxkv and Hugging Face caches."""
    from huggingface_hub import constants

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(home / "mlxkv-cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / ".cache" / "huggingface" / "hub"))
    return home


def fake_ollama(home, gguf, model="tinyllama", tag="latest"):
    """A model as `ollama pull` leaves it: a manifest naming a GGUF blob by digest."""
    root = home / ".ollama" / "models"
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf, root / "blobs" / f"sha256-{digest}")
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
               "size": gguf.stat().st_size},
              {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64, "size": 9}]
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": "sha256:" + "0" * 64, "size": 2}, "layers": layers}
    path = root / "manifests" / "registry.ollama.ai" / "library" / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return root / "blobs" / f"sha256-{digest}"


def fake_lm_studio(home, gguf, llama_dir):
    """LM Studio's models folder: publisher/model/ with GGUF files (and a vision projector), or an MLX model."""
    folder = home / ".lmstudio" / "models" / "lmstudio-community" / "TinyLlama-GGUF"
    folder.mkdir(parents=True)
    shutil.copy(gguf, folder / "tinyllama-Q8_0.gguf")
    (folder / "mmproj-tinyllama-f16.gguf").write_bytes(b"GGUF")
    shutil.copytree(llama_dir, home / ".lmstudio" / "models" / "mlx-community" / "tiny-mlx")


def fake_hugging_face(home, repo_id, files_from):
    """A repo as huggingface_hub caches it: blobs, a snapshot of symlinks, refs/main."""
    repo = home / ".cache" / "huggingface" / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "a" * 40
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in sorted(os.listdir(files_from)):
        data = open(os.path.join(files_from, f), "rb").read()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / f).symlink_to(f"../../blobs/{blob}")
    return repo, snapshot


def listed(capsys) -> dict[str, dict]:
    assert main(["models", "list", "--json"]) == 0
    return {row["name"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}


def test_list_finds_ollama_lm_studio_and_hugging_face_models(home, tiny_gguf, llama_dir, tmp_path, capsys):
    fake_ollama(home, tiny_gguf)
    (tmp_path / "mamba.gguf").write_bytes(tiny_gguf.read_bytes().replace(b"llama", b"mamba", 1))
    fake_ollama(home, tmp_path / "mamba.gguf", model="mamba")
    fake_lm_studio(home, tiny_gguf, llama_dir)
    fake_hugging_face(home, HF_ID, llama_dir)
    rows = listed(capsys)
    for name in (OLLAMA_NAME, LMSTUDIO_GGUF):
        assert (rows[name]["family"], rows[name]["quantization"], rows[name]["served"]) == ("llama", "Q8_0", "yes")
        assert rows[name]["size"] == tiny_gguf.stat().st_size and rows[name]["context"] == 4096
    for name in (LMSTUDIO_MLX, HF_ID):
        assert (rows[name]["family"], rows[name]["quantization"], rows[name]["served"]) == ("llama", "float32", "yes")
    assert rows["ollama:mamba:latest"]["served"] == "no: architecture mamba"
    assert not [name for name in rows if "mmproj" in name]
    assert main(["models", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "FAMILY", "QUANT", "SIZE", "CONTEXT", "SERVED", "FROM"]
    assert any(line.startswith(OLLAMA_NAME) and "Ollama" in line for line in table)


def test_every_listed_name_is_a_model_serve_and_chat_load(home, tiny_gguf, llama_dir, capsys):
    fake_ollama(home, tiny_gguf)
    fake_lm_studio(home, tiny_gguf, llama_dir)
    fake_hugging_face(home, HF_ID, llama_dir)
    rows = listed(capsys)
    for name in set(rows) - {"demo"}:  # demo: tests/models/test_gguf.py
        assert os.path.isfile(os.path.join(fetch.fetch_model(name, lambda *a: None), "config.json")), name
    assert local_model("ollama:tinyllama") == local_model(OLLAMA_NAME)  # Ollama's default tag
    with Engine.load(OLLAMA_NAME, CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0)) as engine:
        from_ollama = engine.generate(PROMPT, max_tokens=6).tokens
    with Engine.load(str(tiny_gguf), CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0)) as engine:
        assert engine.generate(PROMPT, max_tokens=6).tokens == from_ollama
    listed_again = listed(capsys)
    assert listed_again[OLLAMA_NAME]["source"] == "Ollama, imported" and listed_again[OLLAMA_NAME]["imports"]


def _fill_ssd_tier(model: str, disk) -> str:
    with Engine.load(model, CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0, disk_tier=str(disk))) as e:
        e.generate(PROMPT, max_tokens=2)
        e.connector.flush(30)
        return e.fingerprint.hex()


def test_rm_removes_the_import_and_its_ssd_blocks_only_after_a_yes(home, tiny_gguf, llama_dir, tmp_path, capsys):
    blob = fake_ollama(home, tiny_gguf)
    disk = tmp_path / "kv"
    ours, other = _fill_ssd_tier(OLLAMA_NAME, disk), _fill_ssd_tier(llama_dir, disk)
    imported = local_model(OLLAMA_NAME)
    rm = ["models", "rm", "ollama:tinyllama", "--disk-tier", str(disk)]
    assert main(rm) == 2  # no terminal to ask in, no --yes
    assert capsys.readouterr().err.strip().splitlines() == [
        "mlxkv: error: mlxkv models rm asks before it deletes: run it in a terminal, or add --yes"]
    assert os.path.isdir(imported) and (disk / ours).is_dir()
    assert main([*rm, "--yes"]) == 0
    out = capsys.readouterr().out
    assert "stays: it is Ollama's" in out and "its SSD-tier blocks" in out
    assert not os.path.exists(imported) and not (disk / ours).exists()
    assert blob.is_file() and (disk / other).is_dir()  # Ollama's file, another model's blocks


def test_rm_deletes_a_hugging_face_download(home, llama_dir, capsys):
    repo, _ = fake_hugging_face(home, HF_ID, llama_dir)
    assert main(["models", "rm", HF_ID, "--yes"]) == 0
    assert f"removed {HF_ID}:" in capsys.readouterr().out
    assert not repo.exists() and HF_ID not in listed(capsys)
    assert main(["models", "rm", "no/such-model", "--yes"]) == 2
    assert "no model named 'no/such-model' here" in capsys.readouterr().err


def test_pull_shows_progress_and_a_second_pull_finds_it(home, llama_dir, monkeypatch, capsys):
    downloads = []

    def fake_snapshot_download(name, allow_patterns=None, tqdm_class=None, local_files_only=False):
        if local_files_only:
            if not downloads:
                raise FileNotFoundError("not in the cache")
            return downloads[-1]
        bar = tqdm_class(total=200_000_000, unit="B", mininterval=0)
        for _ in range(4):
            bar.update(50_000_000)
        bar.close()
        downloads.append(str(fake_hugging_face(home, name, llama_dir)[1]))
        return downloads[-1]

    monkeypatch.setattr(fetch, "_snapshot_download", fake_snapshot_download)
    assert main(["models", "pull", HF_ID]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == downloads[0]
    progress = err.strip().splitlines()
    assert progress[0] == f"downloading {HF_ID}" and progress[-1] == f"downloading {HF_ID}: 200 / 200 MB"
    assert f"downloading {HF_ID}: 100 / 200 MB" in progress
    assert main(["models", "pull", HF_ID]) == 0
    assert capsys.readouterr().out.strip() == f"{HF_ID} is already downloaded: {downloads[0]}"
    assert len(downloads) == 1
    assert main(["models", "pull", "demo"]) == 2
    assert "already here" in capsys.readouterr().err


def chat_without_a_terminal(*args):
    """`mlxkv chat` as a script runs it: stdin not a terminal. A hang is a timeout, a failure."""
    return subprocess.run([sys.executable, "-m", "mlxkv.cli", "chat", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_chat_without_a_terminal_exits_2_at_once_with_one_line(tmp_path, llama_dir):
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("plain text")
    cases = {"/nonexistent": "mlxkv: error: model not found: '/nonexistent' is not a directory or a Hugging Face id",
             str(not_gguf): "mlxkv: error: notes.gguf is not a GGUF file",
             llama_dir: "mlxkv: error: mlxkv chat needs a terminal"}
    for model, line in cases.items():
        out = chat_without_a_terminal("--model", model)
        assert out.returncode == 2, out.stderr
        [error] = out.stderr.strip().splitlines()
        assert error.startswith(line), error
