"""Every mlx-vlm model family is served with images or not served for a stated reason (vision/families.py).

A new mlx-vlm release with a new family fails here until someone decides: serve it (a tiny model in
tiny_families.py's table, a param of tests/vision/test_vision_engine.py) or give the reason it is not served.
"""

import json
import logging
import pkgutil

import pytest

from mlxkv.errors import MlxkvError
from mlxkv.vision import families, loading, tiny_vlm
from mlxkv.vision.loading import load_vision_model


def _mlx_vlm_families() -> set[str]:
    import mlx_vlm.models  # here: without the vision extra this module still imports, and skips

    return {m.name for m in pkgutil.iter_modules(mlx_vlm.models.__path__) if m.ispkg}


def test_every_mlx_vlm_family_is_served_or_has_a_reason():
    present = _mlx_vlm_families()
    undecided = present - set(families.SERVED) - set(families.NOT_SERVED)
    assert not undecided, f"mlx-vlm families with no decision in mlxkv/vision/families.py: {sorted(undecided)}"
    assert not set(families.SERVED) & set(families.NOT_SERVED)
    listed = [f for _, names in families._REASONS for f in names]
    assert len(listed) == len(set(listed)), "a family listed under two reasons: the later one wins silently"
    gone = (set(families.SERVED) | set(families.NOT_SERVED)) - present
    assert not gone, f"families mlx-vlm no longer has: {sorted(gone)}"
    assert all(reason.strip() for reason in families.NOT_SERVED.values())


def test_each_served_family_has_its_tiny_model_and_its_engine_tests(request):
    """test_vision_engine.py's engine fixture is parametrized by SERVED; each needs its model's fixture
    (conftest.py's VLM_SEEDS makes one per family)."""
    assert tuple(tiny_vlm.VISION_FAMILIES) == tuple(loading.VISION_FAMILIES) == tuple(families.SERVED)
    defined = request.session._fixturemanager.getfixturedefs
    assert [f for f in families.SERVED if not defined(f"{f}_dir", request.node)] == []


def _checkpoint(tmp_path, family: str):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, "vision_config": {"hidden_size": 8}}))
    return tmp_path


def test_a_family_that_cannot_run_over_the_pool_is_refused_at_load_with_its_reason(tmp_path):
    with pytest.raises(MlxkvError) as e:
        load_vision_model(_checkpoint(tmp_path, "paligemma"), "pg", object)
    assert str(e.value) == f"pg: mlx-vlm family 'paligemma' cannot run over mlxkv's pool: {families.BIDIRECTIONAL}"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["llava_bunny", "multi_modality", "fastvlm", "phi4mm"])
def test_a_family_whose_merge_inserts_features_is_refused_at_load_with_that_reason(family, tmp_path):
    """Bunny's get_input_embeddings puts an image's features beside its placeholder: its embeddings
    outgrow its ids, which key the pool's blocks. mlx-lm has no text class for these, so they are refused."""
    with pytest.raises(MlxkvError) as e:
        load_vision_model(_checkpoint(tmp_path, family), "m", object)
    said = str(e.value)
    assert said == f"m: mlx-vlm family {family!r} cannot run over mlxkv's pool: {families.NOT_SERVED[family]}"
    assert said.count(families.INSERTS) == 1 and families.INSERTS_FOUND[family] in said


@pytest.mark.parametrize("family", ["qwen3_5", "llama4"])
def test_a_family_whose_images_are_not_served_loads_its_text_half_with_one_line(family, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mlxkv.vision.loading"):
        assert load_vision_model(_checkpoint(tmp_path, family), "m", object) is None
    assert [r.message for r in caplog.records] == [
        f"m: images with {family!r} are not served ({families.NOT_SERVED[family]}); loading its text half only"]


def test_a_family_mlx_vlm_has_no_class_for_loads_as_text_with_one_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mlxkv.vision.loading"):
        assert load_vision_model(_checkpoint(tmp_path, "no_such_vlm"), "x", object) is None
    assert [r.message for r in caplog.records] == [
        "x: mlx-vlm has no class for family 'no_such_vlm'; loading it as text"]


@pytest.mark.parametrize(("model_type", "family"), [("unlimited-ocr", "unlimited_ocr"),
                                                    ("granite4-vision", "granite4_vision")])
def test_a_variant_model_type_gets_its_family_decision_as_mlx_vlm_remaps_it(model_type, family, tmp_path, caplog):
    """A checkpoint's config may spell its family as mlx-vlm's loader remaps it (`unlimited-ocr`):
    the decision is the family's, not "mlx-vlm has no class"."""
    with caplog.at_level(logging.INFO, logger="mlxkv.vision.loading"):
        try:
            assert load_vision_model(_checkpoint(tmp_path, model_type), "m", object) is None
            said = caplog.records[-1].message
        except MlxkvError as e:
            said = str(e)
    assert f"family {family!r} cannot run" in said or f"images with {family!r} are not served" in said


def test_a_variant_model_type_of_a_served_family_loads_as_a_vision_model(tmp_path):
    """`nemotron_h_omni` is mlx-vlm's nemotron_h_nano_omni, a served family: mlx-vlm's loader is asked
    for it (and fails here on a checkpoint with no weights), rather than the text half being loaded."""
    assert "nemotron_h_nano_omni" in families.SERVED
    with pytest.raises(MlxkvError, match="^could not load vision model 'm': "):
        load_vision_model(_checkpoint(tmp_path, "nemotron_h_omni"), "m", object)


def test_docs_family_table_says_served_exactly_for_the_served_families():
    """docs/vision.md's table of vision families marks a row served iff families.SERVED has it."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "vision.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| .* \| (.*) \|$", doc, flags=re.M))
    assert {f for f, status in rows.items() if status == "**served**"} == set(families.SERVED)
    assert all(f in families.NOT_SERVED for f, status in rows.items() if status != "**served**")


@pytest.mark.parametrize("family", ["moondream2", "hunyuan_vl", "mistral_large3", "ernie4_5_moe_vl", "dots_ocr",
                                    "paddleocr_vl", "granite4_vision"])
def test_a_family_a_try_ruled_out_says_what_it_found_at_load(family, tmp_path, caplog):
    """A refusal names its cause (Moondream's bidirectional prefix, HunYuan-VL's positions kept on the
    model, Mistral Large 3's tokenizer-only processor, ERNIE-4.5-VL's image-token experts); a family
    still not yet run says what its try found, never only "untested"."""
    with caplog.at_level(logging.INFO, logger="mlxkv.vision.loading"):
        try:
            loaded = load_vision_model(_checkpoint(tmp_path, family), "m", object)
            assert loaded is None
            said = caplog.records[-1].message
        except MlxkvError as e:
            said = str(e)
    assert families.NOT_SERVED[family] in said and "\n" not in said
    expected = {"moondream2": families.BIDIRECTIONAL, "hunyuan_vl": families.POSITIONS_ON_MODEL,
                "mistral_large3": families.TOKENIZER_ONLY, "ernie4_5_moe_vl": families.IMAGE_TOKEN_WEIGHTS,
                "paddleocr_vl": families.ONE_PLACE, "granite4_vision": families.LAYER_MAP,
                }.get(family, families.NOT_YET_RUN.get(family))
    assert expected and expected in said
