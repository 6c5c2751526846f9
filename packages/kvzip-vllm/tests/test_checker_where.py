"""The tier benchmark's checker (``kvzip_eval.bench.checker``, over kvzip-vllm's worker): a
restored block that differs from the block stored is counted, and the count says where it was
(request, place in its load job, layers) and whether it equals another stored copy."""

from types import SimpleNamespace

import torch

from kvzip_eval.bench.checker import Checker, fingerprints, form_weights

LAYERS, BLOCKS = 3, 10


def checker(caches):
    c = Checker()
    c._c_init()
    c._c_start(caches)
    return c


def caches(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((BLOCKS, 2, 16, 8), generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def load(req, key, blocks, skip=0):
    return SimpleNamespace(req_id=req, key=key, block_ids=blocks, skip=skip)


def done(job_id):
    return SimpleNamespace(job_id=job_id, failed=[], failed_blocks=set())


def test_fingerprints_tell_one_flipped_bit():
    cs = caches()
    w = form_weights(cs[0][0].numel() * 2 // 2, "cpu")
    a = fingerprints(cs[0], torch.tensor([3]), w)
    cs[0].view(torch.int16)[3, 1, 5, 2] ^= 1
    assert not torch.equal(a, fingerprints(cs[0], torch.tensor([3]), w))


def test_restored_blocks_equal_pass_and_a_differing_one_is_counted_where_it_was():
    cs = caches()
    c = checker(cs)
    stores = [
        SimpleNamespace(key=b"a", block_ids=[0, 1]),
        SimpleNamespace(key=b"b", block_ids=[2, 3]),
    ]
    c._c_copy(stores)
    # restored: "a" twice in one job (two requests sharing it) into 4, 5 and 6, 7; "b" into 8, 9
    for dst, src in ((4, 0), (5, 1), (6, 0), (7, 1), (8, 2), (9, 3)):
        for x in cs:
            x[dst] = x[src]
    cs[2].view(torch.int16)[7, 0, 0, 0] ^= 1  # request r2's copy of "a", its second block, layer 2
    c._c_jobs[5] = [load("r1", b"a", [4, 5]), load("r2", b"a", [6, 7]), load("r2", b"b", [8, 9])]
    c._c_check([done(5)])
    counts = {k: v for k, v in c.counts().items() if k != "differ_where"}
    assert counts == {"blocks_checked": 6, "blocks_differ": 1, "blocks_equal": 5,
                      "restored_blocks_without_copy": 0, "chunks_copied": 2}  # fmt: skip
    where = c.counts()["differ_where"]
    assert where["by_request"] == {"r2": 1}
    assert where["by_loads_of_key_in_job"] == {2: 1}
    assert where["layers_differing"] == 1 and where["by_layer"] == {2: 1}
    assert where["chunk_places_by_request"] == {"r2": [1, 1]}
    assert where["examples"] == [["r2", "1/3", 1, 2, 1, None, None, None]]  # (no tier, no probe)


def test_nothing_differing_reports_no_where():
    cs = caches(1)
    c = checker(cs)
    c._c_copy([SimpleNamespace(key=b"a", block_ids=[0])])
    for x in cs:
        x[5] = x[0]
    c._c_jobs[1] = [load("r", b"a", [5]), load("r", b"missing", [6])]
    c._c_check([done(1)])
    assert c.counts() == {"blocks_checked": 1, "blocks_differ": 0, "blocks_equal": 1,
                          "restored_blocks_without_copy": 1, "chunks_copied": 1}  # fmt: skip


def test_paused_restores_are_counted_not_checked(monkeypatch):
    from kvzip_eval.bench import checker as ck

    cs = caches(2)
    c = checker(cs)
    monkeypatch.setattr(ck, "INSTANCES", [c])
    c._c_copy([SimpleNamespace(key=b"a", block_ids=[0, 1])])
    for x in cs:
        x[4], x[5] = x[0], x[1]
    cs[0].view(torch.int16)[5, 0, 0, 0] ^= 1  # a differing block, restored while paused
    ck.pause(True)
    c._c_jobs[1] = [load("r", b"a", [4, 5])]
    c._c_check([done(1)])
    ck.pause(False)
    assert c.counts() == {"blocks_checked": 0, "blocks_differ": 0, "blocks_equal": 0,
                          "restored_blocks_without_copy": 0, "chunks_copied": 1,
                          "restored_blocks_while_paused": 2}  # fmt: skip
    c._c_jobs[2] = [load("r", b"a", [4, 5])]  # checked again once resumed
    c._c_check([done(2)])
    assert (c.counts()["blocks_checked"], c.counts()["blocks_differ"]) == (2, 1)


def test_a_restored_block_equal_to_a_later_copy_of_its_key_is_told_apart():
    """Two requests computed the same chunk (other batches: other bits) and both stored it:
    a restore of the later copy differs from the reference (the first) and is counted as
    equal to another copy stored; a block equal to neither is not."""
    cs = caches(3)
    c = checker(cs)
    c._c_copy([SimpleNamespace(key=b"a", block_ids=[0, 1])])  # request 1's copy: reference
    for x in cs:  # request 2's copy of the same chunk, one bit apart in its first block
        x[2], x[3] = x[0], x[1]
    cs[1].view(torch.int16)[2, 0, 0, 0] ^= 4
    c._c_copy([SimpleNamespace(key=b"a", block_ids=[2, 3])])
    assert c._c_alts == {b"a": [2]}
    for x in cs:  # restored: request 2's copy into 4, 5; into 6, 7 a copy with another bit
        x[4], x[5], x[6], x[7] = x[2], x[3], x[2], x[3]
    cs[0].view(torch.int16)[6, 1, 1, 1] ^= 1
    c._c_jobs[3] = [load("r", b"a", [4, 5]), load("s", b"a", [6, 7])]
    c._c_check([done(3)])
    got = c.counts()
    assert (got["blocks_checked"], got["blocks_differ"]) == (4, 2)
    where = got["differ_where"]
    assert where["equal_to_another_copy_stored"] == 1
    assert where["keys_stored_more_than_once"] == 1
    assert where["by_request"] == {"r": 1, "s": 1}


def test_the_counts_file_is_written_from_the_steps_poll_not_only_at_shutdown(monkeypatch, tmp_path):
    """``vllm serve``'s engine core may exit without shutting its connector down: the counts
    reach the file from vLLM's once-a-step poll after a check, at most every COUNTS_EVERY_S."""
    import json

    from kvzip_eval.bench import checker as ck

    class Base:
        def get_finished(self, finished_req_ids):
            return None, set(finished_req_ids)

    class Worker(ck.Checker, Base):
        pass

    path = tmp_path / "counts.json"
    monkeypatch.setenv(ck.COUNTS_ENV, str(path))
    cs = caches(2)
    c = Worker()
    c._c_init()
    c._c_start(cs)
    c._c_copy([SimpleNamespace(key=b"a", block_ids=[0])])
    assert c.get_finished({"x"}) == (None, {"x"}) and not path.exists()  # nothing checked yet
    for x in cs:
        x[4] = x[0]
    cs[1].view(torch.int16)[4, 0, 0, 0] ^= 1
    c._c_jobs[1] = [load("r", b"a", [4])]
    c._c_check([done(1)])
    c.get_finished(set())
    counts = json.loads(path.read_text())
    assert counts["blocks_checked"] == 1 and counts["blocks_differ"] == 1
    path.unlink()
    monkeypatch.setattr(ck, "COUNTS_EVERY_S", 3600.0)
    c._c_jobs[2] = [load("r", b"a", [4])]
    c._c_check([done(2)])
    c.get_finished(set())  # within the interval: not rewritten
    assert not path.exists()
    c._c_write()
    assert json.loads(path.read_text())["blocks_checked"] == 2


def test_a_differing_block_is_told_apart_by_the_tiers_stored_copy():
    """For a differing block, the tier's stored copy (decoded again) is compared with the
    reference: equal when the block changed after it was stored (the restore or a later
    write), unequal when the tier holds other bits than the forward computed."""
    from kvzip_vllm.core.pages import Bf16Pages

    cs = caches(3)
    layout = Bf16Pages(kv_heads=2, block_size=16, head_size=4)
    held = {}

    def stored(key, device):  # the tier's copy: what it was given, token-major K, V per layer
        return [t.clone() for t in held[key]]

    c = checker(cs)
    c.tier = SimpleNamespace(layout=layout, drain=lambda: None)
    c.read_block = stored
    c._c_copy([SimpleNamespace(key=b"a", block_ids=[0]), SimpleNamespace(key=b"b", block_ids=[1])])
    for key, block in ((b"a", 0), (b"b", 1)):
        held[key] = [x for cache in cs for x in layout.gather(cache, [block])]
        held[key] = [x.reshape(16, 2, 4) for x in held[key]]
    held[b"b"][1].view(torch.int16)[3, 1, 2] ^= 4  # the tier holds other bits for "b"
    for dst, src in ((4, 0), (5, 1)):
        for x in cs:
            x[dst] = x[src]
    cs[0].view(torch.int16)[4, 1, 0, 0] ^= 1  # "a" changed after its restore
    cs[0].view(torch.int16)[5, 0, 0, 0] ^= 1  # "b" restored from its (other) stored copy
    c._c_jobs[1] = [load("r", b"a", [4]), load("r", b"b", [5])]
    c._c_check([done(1)])
    where = c.counts()["differ_where"]
    assert [e[5] for e in where["examples"]] == [True, False]
    held.clear()  # no longer held
    assert c.differ_where()["examples"][0][5] is None


def test_the_store_paths_staged_copies_are_fingerprinted_as_the_reference_is():
    """The checker fingerprints each chunk's copy where the GPU pipeline (here on the CPU
    device) stages it and where its store thread codes it, with the reference's forms laid out
    token-major: equal to the reference for the blocks as the forward left them; a copy
    changed between staging and coding shows in the layers it changed, at the coding only."""
    import kvzip_lossless
    from kvzip_vllm.core.cuda_pipeline import CudaTierPipeline
    from kvzip_vllm.core.store import BlockStore

    heads, n, d = 2, 16, 8
    g = torch.Generator().manual_seed(5)
    cs = [torch.randn((BLOCKS, heads, n, 2 * d), generator=g).to(torch.bfloat16)
          for _ in range(LAYERS)]  # fmt: skip
    window = [(torch.randn(64, heads, d, generator=g).to(torch.bfloat16),) * 2
              for _ in range(LAYERS)]  # fmt: skip
    store = BlockStore(1 << 26, tables=kvzip_lossless.build_kv_tables([window]))
    pipe = CudaTierPipeline(store, cs, n, bpc=2)
    try:
        c = checker(cs)
        c.tier = SimpleNamespace(pipeline=pipe, layout=pipe.layout)
        c._c_hook_store_path()
        stage = pipe.on_stage

        def stage_then_change(keys, staged):  # after the probe: chunk b's layer 1 K changes
            stage(keys, staged)
            if b"b" in keys:
                staged[1][0][keys.index(b"b"), 20, 1, 3] += 1

        pipe.on_stage = stage_then_change
        stores = [SimpleNamespace(key=b"a", block_ids=[0, 1]),
                  SimpleNamespace(key=b"b", block_ids=[2, 3])]  # fmt: skip
        c._c_copy(stores)
        pipe.start_stores([(st.key, st.block_ids) for st in stores])
        pipe.drain()
        assert sorted(pipe.collect()[0]) == [b"a", b"b"]
        for key in (b"a", b"b"):
            ref = c._bank_rows([c._c_refs[key] + i for i in range(2)])
            assert torch.equal(c._c_at_stage[key], ref)
            same = torch.equal(c._c_at_encode[key], ref)
            assert same == (key == b"a")
        # token 20 of the chunk is its second block's token 4: that block, one layer
        assert [c._c_probes(b"b", i) for i in range(2)] == [[0, 0], [0, 1]]
        assert c._c_probes(b"a", 1) == [0, 0]
    finally:
        pipe.close()


def test_the_control_example_is_a_block_that_compared_equal():
    cs = caches(4)
    c = checker(cs)
    c._c_copy([SimpleNamespace(key=b"a", block_ids=[0]), SimpleNamespace(key=b"b", block_ids=[1])])
    for dst, src in ((4, 0), (5, 1)):
        for x in cs:
            x[dst] = x[src]
    cs[2].view(torch.int16)[5, 0, 0, 0] ^= 1
    c._c_jobs[1] = [load("r", b"a", [4]), load("r", b"b", [5])]
    c._c_check([done(1)])
    where = c.counts()["differ_where"]
    assert where["examples"] == [["r", "1/2", 0, 1, 1, None, None, None]]
    assert where["control"] == ["r", "0/2", 0, 1, 0, None, None, None]
