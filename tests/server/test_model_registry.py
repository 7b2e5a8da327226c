"""The served models' rules, with fakes and a hand-driven clock: names and aliases, the LRU
under --max-loaded and --memory-budget, pins, open requests, keep-alive, the --models file."""

from types import SimpleNamespace

import pytest

from mlxkv.errors import MlxkvError
from mlxkv.kv_format import KVFormat
from mlxkv.server.model_names import ModelNames
from mlxkv.server.model_registry import LOADED, LoadLimits, ModelRegistry
from mlxkv.engine.records import RequestStats
from mlxkv.server.model_stats import model_lines, model_stats
from mlxkv.server.model_specs import NEVER, ModelSpec, alias_flag, duration, model_flag, size
from mlxkv.server.models_file import read_models_file


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def registry(*specs, clock=None, estimate=lambda spec: 0, **limits):
    return ModelRegistry(list(specs), LoadLimits(**limits), clock=clock or Clock(), estimate=estimate)


def load(reg, name, nbytes=0, open_requests=0):
    slot = reg.slot(name)
    reg.loading(slot)
    reg.loaded_as(slot, SimpleNamespace(thread=SimpleNamespace(open_requests=open_requests)), nbytes, 0.1)
    return slot


def test_exact_names_win_then_exact_aliases_then_the_first_matching_pattern_then_the_default():
    names = ModelNames(["coder", "small", "claude-x"],
                       [("claude-*", "coder"), ("claude-haiku-*", "small"), ("gpt-4o", "small")], default="small")
    assert names.resolve("claude-x") == "claude-x"  # a served name is never an alias's
    assert names.resolve("gpt-4o") == "small"
    assert names.resolve("claude-haiku-4-5") == "coder"  # the first pattern given wins
    assert names.resolve("llama") == "small"
    assert ModelNames(["a"], [("b?", "a")]).resolve("zz") is None
    assert "'a'" in ModelNames(["a"]).unknown("zz")
    with pytest.raises(MlxkvError, match="no model is named 'c'"):
        ModelNames(["a"], [("x*", "c")])
    with pytest.raises(MlxkvError, match="--default-model c"):
        ModelNames(["a"], default="c")


def test_flags_parse_names_durations_and_sizes():
    short = lambda source: "short"  # noqa: E731
    assert model_flag("coder=/m/qwen", short) == ModelSpec("coder", "/m/qwen")
    assert model_flag("/m/a=b", short).source == "/m/a=b"  # a path's "=" is no name
    assert model_flag("mlx-community/Qwen3", short) == ModelSpec("short", "mlx-community/Qwen3")
    assert alias_flag("claude-haiku-*=small") == ("claude-haiku-*", "small")
    assert (duration("90s"), duration("5m"), duration("0"), duration("-1"), duration(2)) == (90, 300, 0, NEVER, 2)
    assert (size("512MB"), size("1.5g"), size("100")) == (512 << 20, int(1.5 * (1 << 30)), 100)
    for bad in ("5x", "-2", "1d"):
        with pytest.raises(MlxkvError):
            duration(bad)
    with pytest.raises(MlxkvError):
        size("lots")


def test_least_recently_used_idle_model_goes_first_under_max_loaded():
    clock = Clock()
    reg = registry(ModelSpec("a", "a"), ModelSpec("b", "b"), ModelSpec("c", "c"), clock=clock, max_loaded=2)
    a = load(reg, "a")
    clock.now += 1
    b = load(reg, "b")
    clock.now += 1
    reg.lease(a)
    reg.release(a)  # a is now the more recent
    assert reg.plan(reg.slot("c")) == [b]
    assert registry(ModelSpec("a", "a"), max_loaded=2).plan(reg.slot("a")) == []


def test_each_models_replies_add_up_their_cached_and_image_tokens_in_stats_and_metrics():
    reg = registry(ModelSpec("vl", "vl"), ModelSpec("text", "text"))
    vl, text = load(reg, "vl"), load(reg, "text")
    vl.backend.stats = text.backend.stats = dict
    reg.reply_done(vl, RequestStats(300, {"pool": 64}, 1, 1, image_tokens=256, cached_image_tokens=0))
    reg.reply_done(vl, RequestStats(340, {"pool": 320}, 1, 1, image_tokens=256, cached_image_tokens=256))
    reg.reply_done(text, RequestStats(50, {"pool": 16}, 1, 1))
    rows = {name: model_stats(reg, slot) for name, slot in reg.slots.items()}
    assert (rows["vl"]["image_tokens"], rows["vl"]["cached_image_tokens"]) == (512, 256)
    assert (rows["text"]["image_tokens"], rows["text"]["cached_image_tokens"]) == (0, 0)
    assert rows["vl"]["cached_tokens"] == {"pool": 384} and rows["vl"]["replies"] == 2
    lines = model_lines(rows)
    assert 'mlxkv_model_image_tokens_total{model="vl"} 512' in lines
    assert 'mlxkv_model_cached_image_tokens_total{model="vl"} 256' in lines
    assert 'mlxkv_model_cached_image_tokens_total{model="text"} 0' in lines


def test_pinned_models_and_models_with_open_requests_are_never_chosen():
    reg = registry(ModelSpec("a", "a", pin=True), ModelSpec("b", "b"), ModelSpec("c", "c"), max_loaded=2)
    load(reg, "a")
    b = load(reg, "b", open_requests=1)  # a stream the engine has not finished
    assert reg.plan(reg.slot("c")) is None
    assert "a (pinned)" in reg.blocked_by() and "b (1 open requests)" in reg.blocked_by()
    b.backend.thread.open_requests = 0
    reg.lease(b)  # routed, its response not yet sent
    assert reg.plan(reg.slot("c")) is None
    reg.release(b)
    assert reg.plan(reg.slot("c")) == [b]


def test_memory_budget_counts_weights_and_pools_and_unloads_as_many_as_it_takes():
    clock = Clock()
    reg = registry(*(ModelSpec(n, n) for n in "abcd"), clock=clock, estimate=lambda spec: 60, memory_budget=100)
    a = load(reg, "a", nbytes=30)
    clock.now += 1
    b = load(reg, "b", nbytes=30)
    clock.now += 1
    load(reg, "c", nbytes=30)
    assert reg.plan(reg.slot("d")) == [a, b]  # 90 + 60 > 100; 30 + 60 fits
    big = registry(ModelSpec("x", "x"), estimate=lambda spec: 200, memory_budget=100)
    assert "more than the memory budget" in big.never_fits(big.slot("x"))


def test_keep_alive_expires_idle_models_only():
    clock = Clock()
    reg = registry(ModelSpec("a", "a", keep_alive_s=2), ModelSpec("b", "b", keep_alive_s=NEVER),
                   ModelSpec("c", "c", keep_alive_s=0), clock=clock)
    a, _, c = load(reg, "a"), load(reg, "b"), load(reg, "c", open_requests=1)
    assert reg.expired() == []  # c's request is still open
    c.backend.thread.open_requests = 0
    assert reg.expired() == [c]
    clock.now += 2
    assert reg.expired() == [a, c]
    reg.unloading(a)
    reg.unloaded(a)
    assert (a.state, a.unloads, reg.loaded()[0].state) == ("unloaded", 1, LOADED)


def test_models_file(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('max_loaded = 1\nkeep_alive = "2m"\nmemory_budget = "8GB"\n'
                    '[models.coder]\nsource = "/m/coder"\nkv_bits = 8\npin = true\n'
                    '[models.small]\nsource = "/m/small"\nkeep_alive = "-1"\ncontext = 4096\n'
                    '[aliases]\n"claude-haiku-*" = "small"\n"claude-*" = "coder"\n')
    f = read_models_file(str(path))
    assert f.specs == [ModelSpec("coder", "/m/coder", pin=True, kv_format=KVFormat(8)),
                       ModelSpec("small", "/m/small", keep_alive_s=NEVER, context=4096)]
    assert f.aliases == [("claude-haiku-*", "small"), ("claude-*", "coder")]
    assert (f.max_loaded, f.keep_alive_s, f.memory_budget) == (1, 120, 8 << 30)
    for text, message in (('[models.a]\nsource = "x"\nbits = 4\n', "unknown option 'bits'"),
                          ('[models.a]\nkv_bits = 8\n', "needs a source"),
                          ('[models.a]\nsource = "x"\nkv_bits = 3\n', ": model 'a': kv_bits must be 4 or 8, got 3$"),
                          ('[models.a]\nsource = "x"\nkv_bits = true\n',
                           ": model 'a': kv_bits must be 4 or 8, got True$"),
                          ('max_loaded = 0\n', "max_loaded"), ('models = [', "not valid TOML")):
        path.write_text(text)
        with pytest.raises(MlxkvError, match=message):
            read_models_file(str(path))


def test_a_models_own_options_land_in_its_cache_config():
    from mlxkv.config import CacheConfig
    from mlxkv.server.server import model_cache

    base = CacheConfig(block_size=16, disk_tier="/ssd")
    cache = model_cache(base, ModelSpec("a", "a", kv_format=KVFormat(8), speculative="lookup", context=1000))
    assert (cache.kv_format.bits, cache.speculative, cache.num_blocks, cache.disk_tier) == (8, "lookup", 63, "/ssd")
    assert cache.engine_config().pool.kv_format.bits == 8 and base.kv_format is None  # the server's is unchanged
    assert model_cache(base, ModelSpec("b", "b"), pool_bytes=1 << 30).memory_budget_bytes == 1 << 30
    grouped = model_cache(CacheConfig(kv_group_size=32), ModelSpec("c", "c", kv_format=KVFormat(4)))
    assert grouped.engine_config().pool.kv_format == KVFormat(4, 32)  # in the server's --kv-group-size
