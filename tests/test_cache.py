"""Tuned-config lookup: exact -> nearest bucket -> default; stale, corrupt, overlay."""

from __future__ import annotations

import json
import warnings

import pytest

from kernel_factory.generator import ADAMW, cache, get_family, template_hash

VARIANT = ADAMW.variant()
KEY = ADAMW.tuning_key(VARIANT)


def _entry(bucket, block, family="adamw"):
    return {"family": family, "variant": KEY, "dtype": "float32", "bucket": bucket,
            "config": dict(ADAMW.default_config, BLOCK=block, CHUNK=4096)}  # fmt: skip


def _write(path, entries, hashes=None, schema=cache.SCHEMA_VERSION):
    data = {"schema": schema, "template_hashes": hashes or {"adamw": template_hash(ADAMW)},
            "entries": entries}  # fmt: skip
    cache.write_cache_file(path, data)


@pytest.fixture
def arch_files(tmp_path, monkeypatch):
    """Point the packaged and the overlay file of arch 'smtest' into tmp_path."""
    packaged, overlay = tmp_path / "pkg" / "smtest.json", tmp_path / "user" / "smtest.json"
    monkeypatch.setattr(cache, "packaged_cache_path", lambda arch: packaged)
    monkeypatch.setattr(cache, "overlay_cache_path", lambda arch: overlay)
    cache.clear()
    yield packaged, overlay
    cache.clear()


def test_exact_then_nearest_bucket_then_default(arch_files):
    packaged, _ = arch_files
    _write(packaged, [_entry(1 << 20, 256), _entry(1 << 27, 1024)])
    assert cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20)["BLOCK"] == 256
    assert cache.select(ADAMW, "smtest", VARIANT, "float32", (1 << 26) + 5)["BLOCK"] == 1024
    with pytest.warns(RuntimeWarning, match="no tuned"):
        assert cache.select(ADAMW, "smtest", VARIANT, "bfloat16", 100) == ADAMW.default_config


def test_default_fallback_warns_once(arch_files):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (10, 1000, 10**6):
            cache.select(ADAMW, "smtest", VARIANT, "float32", n)
    assert sum("no tuned" in str(w.message) for w in caught) == 1


def test_stale_template_hash_is_ignored_with_a_warning(arch_files):
    packaged, _ = arch_files
    _write(packaged, [_entry(1 << 20, 256)], hashes={"adamw": "0" * 64})
    with pytest.warns(RuntimeWarning, match="another version"):
        config = cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20)
    assert config == ADAMW.default_config


def test_template_hash_ignores_comments_but_not_code():
    """Editing a template's comments keeps its tuned entries; editing its code stales them."""
    from kernel_factory.generator.render import template_code, template_source

    source = template_source(ADAMW)
    added = "{# a new Jinja\n   comment #}\n    # a new comment line\nimport triton\n"
    commented = source.replace("import triton\n", added, 1)
    assert commented != source and template_code(commented) == template_code(source)
    code_edits = (source.replace("tl.store", "tl.store ", 1),
                  source.replace("import triton\n", "import triton  # inline\n", 1))  # fmt: skip
    for edit in code_edits:
        assert template_code(edit) != template_code(source)  # code, and comments after code, count


@pytest.mark.parametrize("text", ["{not json", '{"schema": 999, "entries": [], "template_hashes": {}}', "[]"])
def test_corrupt_file_warns_and_defaults(arch_files, text):
    packaged, _ = arch_files
    packaged.parent.mkdir(parents=True)
    packaged.write_text(text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20)
    assert config == ADAMW.default_config
    assert [str(w.message) for w in caught if "ignoring tuning cache" in str(w.message)]


def test_user_overlay_wins(arch_files):
    packaged, overlay = arch_files
    _write(packaged, [_entry(1 << 20, 256)])
    _write(overlay, [_entry(1 << 20, 2048)])
    assert cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20)["BLOCK"] == 2048


def test_no_file_io_after_first_lookup(arch_files, monkeypatch):
    packaged, _ = arch_files
    _write(packaged, [_entry(1 << 20, 256)])
    first = cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20)
    monkeypatch.setattr(cache, "_read", lambda *a: pytest.fail("file read after first lookup"))
    assert cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20) is first


def test_written_file_is_sorted_json(tmp_path):
    path = tmp_path / "x.json"
    cache.write_cache_file(path, {"b": 1, "a": {"d": 2, "c": 3}})
    text = path.read_text()
    assert text.index('"a"') < text.index('"b"') and json.loads(text)["a"]["c"] == 3
    assert not list(tmp_path.glob("*.tmp"))


def test_packaged_sm90_cache_is_well_formed():
    """The checked-in cache parses, names only legal configs, and each entry beats or equals
    the family default it was measured against."""
    data = json.loads(cache.packaged_cache_path("sm90").read_text())
    assert data["schema"] == cache.SCHEMA_VERSION and data["arch"] == "sm90"
    assert set(data["environment"]) >= {"gpu", "capability", "torch", "triton", "cuda"}
    assert data["entries"]
    for entry in data["entries"]:
        get_family(entry["family"]).check_config(entry["config"])
        assert entry["p20_ms"] <= entry["p50_ms"] <= entry["p80_ms"]
        # The tuner's paired final timing keeps the default unless the winner beats it there.
        assert entry["p50_ms"] <= entry["default_p50_ms"], entry


def test_packaged_sm90_cache_matches_every_template():
    """Every family's entries were tuned on its current template, so none is ignored as stale."""
    data = json.loads(cache.packaged_cache_path("sm90").read_text())
    for family in {e["family"] for e in data["entries"]}:
        assert data["template_hashes"][family] == template_hash(get_family(family)), family
    for companion in {get_family(e["family"]).impl_templates.get(e["config"].get("impl")) for e in data["entries"]}:
        if companion is not None:  # the template an impl of some entries runs (newton_schulz's stream_k)
            assert data["template_hashes"][companion] == template_hash(get_family(companion)), companion


def test_merge_keeps_current_entries_replaces_same_key_and_drops_stale(tmp_path):
    path = tmp_path / "smtest.json"
    cache.merge_entries(path, "smtest", [_entry(1 << 20, 256), _entry(1 << 22, 512)])
    cache.merge_entries(path, "smtest", [_entry(1 << 20, 1024)])
    data = json.loads(path.read_text())
    assert {(e["bucket"], e["config"]["BLOCK"]) for e in data["entries"]} == {(1 << 20, 1024), (1 << 22, 512)}
    assert data["template_hashes"] == {"adamw": template_hash(ADAMW)}
    _write(path, [_entry(1 << 22, 512)], hashes={"adamw": "0" * 64})  # now tuned on another template
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache.merge_entries(path, "smtest", [_entry(1 << 20, 256)])
    assert [e["bucket"] for e in json.loads(path.read_text())["entries"]] == [1 << 20]
    # an entry keyed by a variant the family's axes no longer have (tuning axes changed) is dropped
    _write(path, [_entry(1 << 20, 256), dict(_entry(1 << 22, 512), variant="multi_tensor=True")])
    cache.merge_entries(path, "smtest", [_entry(1 << 24, 256)])
    assert [e["bucket"] for e in json.loads(path.read_text())["entries"]] == [1 << 20, 1 << 24]


def test_merge_keeps_other_families_entries_tuned_on_another_template(tmp_path):
    """Tuning one family from a tree whose template of another family differs (one being edited)
    keeps that family's entries and the hash they were tuned on: they still match the file's
    template, and a lookup in such a tree ignores them anyway."""
    path = tmp_path / "smtest.json"
    other = dict(_entry(1 << 20, 256), family="adam_mini", variant="multi_tensor=True,momentum=float32")
    _write(path, [_entry(1 << 22, 512), other], hashes={"adamw": template_hash(ADAMW), "adam_mini": "1" * 64})
    cache.merge_entries(path, "smtest", [_entry(1 << 20, 1024)])
    data = json.loads(path.read_text())
    assert data["template_hashes"] == {"adamw": template_hash(ADAMW), "adam_mini": "1" * 64}
    assert sorted((e["family"], e["bucket"]) for e in data["entries"]) == [
        ("adam_mini", 1 << 20), ("adamw", 1 << 20), ("adamw", 1 << 22)]  # fmt: skip
    # tuning that family itself replaces its stale entries and records the tree's hash
    cache.merge_entries(path, "smtest", [dict(_entry(1 << 24, 256), family="adam_mini", variant=other["variant"],
                                              config=dict(get_family("adam_mini").default_config))])  # fmt: skip
    data = json.loads(path.read_text())
    assert data["template_hashes"]["adam_mini"] == template_hash(get_family("adam_mini"))
    assert [e["bucket"] for e in data["entries"] if e["family"] == "adam_mini"] == [1 << 24]


def _on(device, entry):
    return dict(entry, device=device)


def test_this_gpus_entries_first_then_another_gpus_with_one_warning(arch_files):
    packaged, _ = arch_files
    _write(packaged, [_on("GPU A", _entry(1 << 20, 256)), _on("GPU B", _entry(1 << 20, 512))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a GPU with its own entries: no warning
        assert cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20, device="GPU A")["BLOCK"] == 256
        assert cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20, device="GPU B")["BLOCK"] == 512
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20, device="GPU C")
        cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 22, device="GPU C")
    assert config["BLOCK"] == 256  # the same architecture's entries, in a fixed order (GPU A's first)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "GPU A, GPU B" in messages[0] and "GPU C" in messages[0]


def test_an_entry_without_device_was_tuned_on_its_files_gpu(arch_files):
    packaged, _ = arch_files
    data = {"schema": cache.SCHEMA_VERSION, "template_hashes": {"adamw": template_hash(ADAMW)},
            "environment": {"gpu": "GPU A"}, "entries": [_entry(1 << 20, 256)]}  # fmt: skip
    cache.write_cache_file(packaged, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20, device="GPU A")["BLOCK"] == 256
    with pytest.warns(RuntimeWarning, match="not on this GPU B"):
        assert cache.select(ADAMW, "smtest", VARIANT, "float32", 1 << 20, device="GPU B")["BLOCK"] == 256


def test_merge_keeps_other_gpus_entries(tmp_path, monkeypatch):
    path = tmp_path / "smtest.json"
    for gpu, block in (("GPU A", 256), ("GPU B", 512), ("GPU B", 1024)):
        monkeypatch.setattr(cache, "environment", lambda gpu=gpu: {"gpu": gpu})
        cache.merge_entries(path, "smtest", [_entry(1 << 20, block)])
    data = json.loads(path.read_text())
    assert {(e["device"], e["config"]["BLOCK"]) for e in data["entries"]} == {("GPU A", 256), ("GPU B", 1024)}
    assert data["environment"] == {"gpu": "GPU B"}


def test_a_nearest_axis_breaks_ties_between_buckets_equally_near(arch_files):
    # newton_schulz's side: the entry nearest in work first, then the nearest side
    from kernel_factory.generator import NEWTON_SCHULZ

    packaged, _ = arch_files

    def entry(side, bucket, group_m):  # GROUP_M tells the entries apart
        variant = NEWTON_SCHULZ.variant(product="gram", side=side)
        return {"family": "newton_schulz", "variant": NEWTON_SCHULZ.tuning_key(variant), "dtype": "bfloat16",
                "bucket": bucket, "config": dict(NEWTON_SCHULZ.default_config, GROUP_M=group_m)}  # fmt: skip

    _write(packaged, [entry(1024, 1 << 38, 1), entry(2048, 1 << 38, 4), entry(8192, 1 << 42, 8)],
           hashes={"newton_schulz": template_hash(NEWTON_SCHULZ)})  # fmt: skip
    pick = lambda side, work: cache.select(NEWTON_SCHULZ, "smtest", NEWTON_SCHULZ.variant(product="gram", side=side),
                                           "bfloat16", work)["GROUP_M"]  # fmt: skip  # noqa: E731
    assert pick(2048, 1 << 38) == 4 and pick(1024, 1 << 38) == 1  # same work: the side decides
    assert pick(2048, 1 << 43) == 8 and pick(1024, 1 << 41) == 8  # the work first
    assert pick(4096, 1 << 38) == 4  # 2048 is nearer 4096 than 1024
    with pytest.warns(RuntimeWarning, match="no tuned"):  # other axes still match exactly
        cache.select(NEWTON_SCHULZ, "smtest", NEWTON_SCHULZ.variant(product="poly", side=2048), "bfloat16", 1 << 38)


H100 = "NVIDIA H100 80GB HBM3"
# Families whose template changed after an H100 was last lent (TurboAdam's m codec, AdamMini's
# flush of tiny momentum): their H100 entries went stale with it, and an H100 takes the H200's
# entries for them, with one warning, until `nox -s tune -- --arch sm90 --families turbo_adam,adam_mini`
# runs on an H100.
AWAITING_H100 = {"turbo_adam", "adam_mini"}


@pytest.mark.parametrize("gpu", [H100, "NVIDIA H200"])
def test_every_model_finds_entries_tuned_on_its_gpu(gpu, monkeypatch, tmp_path):
    """Each family's lookups for the bench's model lists (fp32 and bf16 params; NS for every batch of
    same-shape hidden matrices) find entries of sm90.json tuned on that very GPU: another GPU's
    entries or a family default would warn, and warnings fail here. The families of
    ``AWAITING_H100`` find the H200's on an H100: another GPU's warning, never the default's."""
    from collections import Counter

    from model_lookups import elementwise_lookups

    from kernel_factory.generator import NEWTON_SCHULZ
    from kernel_factory.optimizers.muon.newton_schulz_launch import PRODUCTS, iteration_flops, side_class
    from kernel_factory.optimizers.shared.workloads import MODELS, hidden_matrices, llama_param_shapes

    monkeypatch.setattr(cache, "overlay_cache_path", lambda arch: tmp_path / "none.json")  # the packaged file
    cache.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _, family, variant, dtype, n in elementwise_lookups():
                if gpu == H100 and family.name in AWAITING_H100:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        cache.select(family, "sm90", variant, dtype, n, device=gpu)
                    assert all("tuned on NVIDIA H200, not on this" in str(w.message) for w in caught), family.name
                    continue
                cache.select(family, "sm90", variant, dtype, n, device=gpu)
            for config in MODELS.values():
                hidden = hidden_matrices(llama_param_shapes(**config))
                for (m, n), count in Counter(tuple(sorted(s)) for _, s in hidden).items():
                    for product in PRODUCTS:
                        variant = NEWTON_SCHULZ.variant(dtype="bfloat16", product=product, side=side_class(m))
                        work = iteration_flops(count, m, n)
                        cache.select(NEWTON_SCHULZ, "sm90", variant, "bfloat16", work, device=gpu)
    finally:
        cache.clear()


def test_an_impl_on_another_template_goes_stale_with_that_template(arch_files, tmp_path):
    """newton_schulz's stream_k configs run newton_schulz_stream_k.py.j2: the file keeps that
    template's hash too, and only the entries of that impl go stale when it changes."""
    ns = get_family("newton_schulz")
    variant = ns.variant(dtype="bfloat16", product="gram", side=2048)
    key = ns.tuning_key(variant)

    def entry(bucket, impl):
        return {"family": "newton_schulz", "variant": key, "dtype": "bfloat16", "bucket": bucket,
                "config": dict(ns.default_config, impl=impl)}  # fmt: skip

    path = tmp_path / "smtest.json"
    cache.merge_entries(path, "smtest", [entry(1 << 36, "hopper"), entry(1 << 38, "stream_k")])
    hashes = json.loads(path.read_text())["template_hashes"]
    assert hashes == {"newton_schulz": template_hash(ns),
                      "newton_schulz_stream_k": template_hash(get_family("newton_schulz_stream_k"))}  # fmt: skip
    packaged, _ = arch_files
    _write(packaged, [entry(1 << 36, "hopper"), entry(1 << 38, "stream_k")], hashes)
    assert cache.select(ns, "smtest", variant, "bfloat16", 1 << 38)["impl"] == "stream_k"
    cache.clear()
    _write(packaged, [entry(1 << 36, "hopper"), entry(1 << 38, "stream_k")],
           dict(hashes, newton_schulz_stream_k="0" * 64))  # fmt: skip
    with pytest.warns(RuntimeWarning, match="another version"):
        assert cache.select(ns, "smtest", variant, "bfloat16", 1 << 38)["impl"] == "hopper"  # the nearest fresh one
    # tuning the family again drops the stale entry and records the companion's current hash
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache.merge_entries(packaged, "smtest", [entry(1 << 40, "hopper")])
    data = json.loads(packaged.read_text())
    assert sorted(e["bucket"] for e in data["entries"]) == [1 << 36, 1 << 40]
    assert data["template_hashes"] == hashes
