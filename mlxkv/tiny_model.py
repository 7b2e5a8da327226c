"""Tiny random-weight models in the Hugging Face layout.

`write_tiny_model` writes a directory that `mlx_lm.load` opens like any
downloaded checkpoint: config.json, model.safetensors, and a byte-level BPE
tokenizer with a ChatML template. Nothing is downloaded: the tokenizer is
trained on a built-in corpus and the weights are drawn from `seed`, so the
same spec always gives byte-identical files. Tests and the `demo` model use it.
"""

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import platformdirs
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mlxkv.errors import MlxkvError

# Extra config.json keys per family, on top of the ones every family shares.
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "phi3": {},
    "starcoder2": {"norm_epsilon": 1e-5},
    "olmo2": {},
    # Sliding-window layers: make_cache() returns RotatingKVCache, so this
    # family exists to exercise the "unsupported model family" path.
    "gemma3_text": {"sliding_window": 64, "sliding_window_pattern": 2},
}
UNSUPPORTED_CACHE_FAMILY = "gemma3_text"
GAINS = {"lm_head": 4.0}
# These attention classes derive head_dim from hidden_size / num_heads.
_DERIVED_HEAD_DIM = {"qwen2", "phi3", "starcoder2"}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MAX_VOCAB_SIZE = 65536  # the built-in corpus fills exactly this many tokens
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    family: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    vocab_size: int = 512
    intermediate_size: int | None = None
    dtype: str = "float32"
    seed: int = 0
    max_position_embeddings: int = 4096

    def __post_init__(self):
        _check_choice("model family", self.family, FAMILIES)
        _check_choice("dtype", self.dtype, DTYPES)
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size",
                     "max_position_embeddings", "head_dim", "intermediate_size", "seed"):
            value, low = getattr(self, name), 0 if name == "seed" else 1
            if not (value is None and name in ("head_dim", "intermediate_size")):
                if type(value) is not int or value < low:
                    raise MlxkvError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise MlxkvError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise MlxkvError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_heads ({self.num_heads})")
        if (self.family in _DERIVED_HEAD_DIM and self.head_dim is not None
                and self.head_dim * self.num_heads != self.hidden_size):
            raise MlxkvError(f"{self.family} needs head_dim == hidden_size / num_heads; "
                             "leave head_dim unset")
        if self.resolved_head_dim % 2:
            raise MlxkvError(f"head_dim must be even for rotary embeddings, "
                             f"got {self.resolved_head_dim}")
        low = 256 + len(SPECIAL_TOKENS)
        if not low <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise MlxkvError(f"vocab_size must be between {low} (bytes + special tokens) "
                             f"and {MAX_VOCAB_SIZE}, got {self.vocab_size}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


def _check_choice(what: str, value: str, choices) -> None:
    if value not in choices:
        raise MlxkvError(f"unknown {what} {value!r}; choose one of: {', '.join(choices)}")


DEMO_SPEC = TinyModelSpec(hidden_size=128, vocab_size=1024)


def model_config(spec: TinyModelSpec) -> dict:
    """The config.json contents; mlx-lm's ModelArgs.from_dict ignores extra keys."""
    head_dim = spec.resolved_head_dim
    return {
        "model_type": spec.family,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "intermediate_size": spec.intermediate_size or 3 * spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        # An untied head lets _random_weights set the logit scale on its own.
        "tie_word_embeddings": False,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")],
        "torch_dtype": spec.dtype,
        "mlxkv_tiny_model": dataclasses.asdict(spec),
        **FAMILIES[spec.family],
    }


def _random_weights(config: dict, spec: TinyModelSpec) -> dict[str, mx.array]:
    """Weights named and shaped by mlx-lm's own class, drawn from `spec.seed`.

    The class's initialisers use the global RNG; we redraw every random
    tensor from an explicit key so no global state is touched or relied on.
    """
    from mlx_lm.utils import MODEL_REMAPPING  # deferred: pulls in transformers

    arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(spec.family, spec.family)}")
    params = sorted(tree_flatten(arch.Model(arch.ModelArgs.from_dict(config)).parameters()))
    keys = mx.random.split(mx.random.key(spec.seed), len(params))
    weights = {}
    for key, (name, value) in zip(keys, params):
        if value.ndim >= 2:
            # std 1/sqrt(fan_in) keeps activations O(1); the head is scaled
            # up so greedy decoding depends on context instead of looping.
            gain = GAINS.get(name.split(".")[-2], 1.0)
            value = gain * mx.random.normal(value.shape, key=key) / value.shape[-1] ** 0.5
        elif name.endswith(".bias"):
            value = 0.02 * mx.random.normal(value.shape, key=key)
        # Other 1-D tensors are norm scales, constants in every class.
        weights[name] = value.astype(DTYPES[spec.dtype])
    mx.eval(weights)
    return weights


def _corpus(vocab_size: int) -> list[str]:
    """English-ish text, then made-up words until BPE can fill `vocab_size`."""
    english = (
        "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?\n"
        "Once upon a time a small model lived in a cache. It read every token and wrote\n"
        "keys and values into blocks of memory; when the same prompt came back, it\n"
        "remembered the prefix and skipped the work. Numbers: 0 1 2 3 10 42 100 2024.\n"
        'Questions? Answers! "Quotes", (parens), [brackets], {braces} - and dashes.\n'
        'def main():\n    print("hello")\n    return 0\n'
    )
    onsets = "b c d f g h j k l m n p r s t v w y z br ch cl dr fl gr pl sh st th tr".split()
    vowels = "a e i o u ai ea ee oo ou".split()
    codas = ["", "n", "r", "s", "t", "l", "m", "nd", "st", "ng"]
    syllables = ["".join(p) for p in itertools.product(onsets, vowels, codas)]
    n = len(syllables)
    # 7919 is prime and coprime to n*n, so this walks distinct syllable pairs.
    pairs = (divmod(i * 7919 % (n * n), n) for i in range(2 * vocab_size))
    return [english] * 20 + [" ".join(syllables[a] + syllables[b] for a, b in pairs)]


def _tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, even unseen ones, so any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(vocab_size), trainer)
    return tokenizer


def _write_files(directory: Path, spec: TinyModelSpec) -> None:
    config = model_config(spec)
    mx.save_safetensors(str(directory / "model.safetensors"), _random_weights(config, spec), {"format": "mlx"})
    _tokenizer(spec.vocab_size).save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    for name, content in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        (directory / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def _is_model(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _build(path: Path, spec: TinyModelSpec) -> Path:
    """Write the model into a fresh temp dir beside `path`; return the temp dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _write_files(staging, spec)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def write_tiny_model(path: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a random-weight model to `path`, replacing a model already there.

    Readers see either the old complete model or the new one, never a mix.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise MlxkvError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not _is_model(path):
        raise MlxkvError(f"{path} is not empty and holds no model; pick an empty or new directory")
    staging = _build(path, spec)
    old = None
    if _is_model(path):
        # rename() will not replace a non-empty directory, so move it aside.
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
        os.rename(path, old / "model")
    os.rename(staging, path)  # an empty directory is replaced atomically
    if old is not None:
        shutil.rmtree(old)
    return path


def _cache_root() -> Path:
    return Path(os.environ.get("MLXKV_CACHE_DIR") or platformdirs.user_cache_dir("mlxkv"))


def _written_spec(path: Path) -> dict | None:
    try:
        return json.loads((path / "config.json").read_text()).get("mlxkv_tiny_model")
    except (OSError, ValueError):
        return None


def demo_model_path() -> Path:
    """The demo model, written into the user cache on first use and reused.

    Processes racing to create it each build privately; the first rename
    wins and the others discard theirs.
    """
    path = _cache_root() / "models" / "demo"
    if _written_spec(path) == dataclasses.asdict(DEMO_SPEC):
        return path
    if path.exists():  # written by an older mlxkv with a different DEMO_SPEC
        return write_tiny_model(path, DEMO_SPEC)
    staging = _build(path, DEMO_SPEC)
    try:
        os.rename(staging, path)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not _is_model(path):
            raise
    return path


def resolve_model(name: str) -> str:
    """Map the name `demo` to the demo model's path; pass others through."""
    return str(demo_model_path()) if name == "demo" else name


def add_tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    d = TinyModelSpec()
    parser.add_argument("dir", help="directory to write the model into (new, empty, or an earlier tiny model)")
    parser.add_argument("--family", default=d.family, choices=list(FAMILIES), help="mlx-lm model family")
    parser.add_argument("--layers", type=int, default=d.num_layers, help="transformer layers")
    parser.add_argument("--hidden-size", type=int, default=d.hidden_size, help="model width")
    parser.add_argument("--heads", type=int, default=d.num_heads, help="attention (query) heads")
    parser.add_argument("--kv-heads", type=int, default=d.num_kv_heads, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=d.head_dim, help="per-head width (default: hidden-size / heads)")
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size, help="tokenizer and embedding size")
    parser.add_argument("--intermediate-size", type=int, default=d.intermediate_size, help="MLP width (default: 3 * hidden-size)")
    parser.add_argument("--dtype", default=d.dtype, choices=list(DTYPES), help="weight dtype")
    parser.add_argument("--seed", type=int, default=d.seed, help="weights are a pure function of the spec and this seed")


def spec_from_args(args: argparse.Namespace) -> TinyModelSpec:
    return TinyModelSpec(
        family=args.family,
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        intermediate_size=args.intermediate_size,
        dtype=args.dtype,
        seed=args.seed,
    )
