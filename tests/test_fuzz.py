"""Fuzzing the tar/npy reading path: random corruptions never hang, never unpickle, and fail only as ShardError.

A small dataset is packed once; each hypothesis example copies it, flips / overwrites /
truncates bytes at random offsets of one shard (biased towards the .npy headers, where the
checks are), and iterates a full epoch. Allowed outcomes: a ShardError, or a clean pass in
which every window equals the original array: every byte a read covers is verified against
the manifest's chunk checksums, so no changed byte is trained on. A corruption that touches
no checksum chunk holding member content, and truncates nothing, must pass. Pickle is
booby-trapped during the loop.

``streamwin.npyfmt.parse_npy_header`` is fuzzed directly with random and near-valid headers:
it may only raise ValueError.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import io
import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamwin as sw
from conftest import forbid_unpickling, make_sequences
from streamwin.formats import npy as npyfmt

W, S, H, B = 8, 4, 2, 4
FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def make_loader(url, **kw):
    args = dict(window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=64, seed=0) | kw
    return sw.WindowLoader(sw.WindowDataset(str(url), **args))


@dataclasses.dataclass
class Pristine:
    root: Path
    seqs: dict = dataclasses.field(repr=False)
    shards: list[str] = dataclasses.field(repr=False)
    sizes: dict = dataclasses.field(repr=False)  # shard -> bytes
    members: dict = dataclasses.field(repr=False)  # shard -> [(key, data offset, size, header length)]
    compressed: bool = False

    def headers(self, shard: str) -> list[tuple[int, int]]:
        return [(off, off + hlen) for _, off, _, hlen in self.members[shard]]


def _pack(root: Path, compression=None) -> Pristine:
    seqs = make_sequences(12, seed=11, max_len=80)
    sw.pack(list(seqs.items()), str(root), shard_bytes=6_000, progress=False, compression=compression)
    shards = sorted(p.name for p in root.glob("*.tar"))
    members, sizes = {}, {}
    for s in shards:
        sizes[s] = (root / s).stat().st_size
        with tarfile.open(root / s) as tf:
            rows = []
            for m in tf.getmembers():
                if m.name.endswith(".json"):
                    continue
                raw = tf.extractfile(m).read()
                if compression:
                    import zstandard

                    raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 24)
                hlen = 10 + int.from_bytes(raw[8:10], "little")
                rows.append((m.name.split(".")[0], m.offset_data, m.size, hlen))
            members[s] = rows
    assert len(shards) >= 2
    # the pristine dataset reads exactly
    for b in make_loader(root):
        for i, (k, s0) in enumerate(zip(b["key"], b["start"].tolist())):
            assert np.array_equal(b["x"][i].numpy(), seqs[k][s0 : s0 + W])
    return Pristine(root, seqs, shards, sizes, members, bool(compression))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return _pack(tmp_path_factory.mktemp("fuzz") / "ds")


@pytest.fixture(scope="module")
def pristine_zstd(tmp_path_factory):
    return _pack(tmp_path_factory.mktemp("fuzzz") / "ds", compression="zstd")


@st.composite
def corruptions(draw, p: Pristine):
    """(shard, [ops]) with ops ("flip", pos, mask) | ("write", pos, bytes) | ("truncate", pos)."""
    shard = draw(st.sampled_from(p.shards))
    size = p.sizes[shard]
    header_bytes = [i for a, b in p.headers(shard) for i in range(a, b)]
    pos = st.one_of(st.integers(0, size - 1), st.sampled_from(header_bytes))
    op = st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(1, 255)),
        st.tuples(st.just("write"), pos, st.binary(min_size=1, max_size=12)),
        st.tuples(st.just("write"), pos, st.sampled_from([b"'|O'", b"'<f8'", b"True ", b"(99999999999, 3)", b"\x02\x00",
                                                         b"\xff\xff", b"\x00" * 8, b"(((((((("])),
        st.tuples(st.just("truncate"), st.integers(0, size - 1)),
    )
    return shard, draw(st.lists(op, min_size=1, max_size=3))


def apply(path: Path, ops) -> tuple[list[tuple[int, int]], bool]:
    """Apply ops; returns the byte intervals that differ from the original, and whether it was truncated."""
    orig = path.read_bytes()
    data = bytearray(orig)
    for op in ops:
        if op[0] == "flip":
            if op[1] < len(data):
                data[op[1]] ^= op[2]
        elif op[0] == "write":
            at, new = op[1], op[2]
            if at < len(data):
                data[at : at + len(new)] = new[: len(data) - at]
        else:
            del data[op[1] :]
    path.write_bytes(bytes(data))
    a = np.frombuffer(orig[: len(data)], np.uint8)
    diff = np.flatnonzero(a != np.frombuffer(bytes(data), np.uint8))
    touched = [(int(i), int(i) + 1) for i in diff]
    truncated = len(data) < len(orig)
    if truncated:
        touched.append((len(data), 1 << 62))
    return touched, truncated


def overlaps(intervals, lo, hi) -> bool:
    return any(a < hi and lo < b for a, b in intervals)


def _booby_trap(mp: pytest.MonkeyPatch) -> None:
    forbid_unpickling(mp)


def run_corrupted(p: Pristine, shard: str, ops) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ds = Path(tmp) / "ds"
        shutil.copytree(p.root, ds)
        touched, truncated = apply(ds / shard, ops)
        c = sw.load_manifest(str(p.root)).checks.chunk  # a read verifies whole chunks: any touched byte in a
        checked = [(off // c * c, -(-(off + size) // c) * c) for _, off, size, _ in p.members[shard]]  # member's
        may_fail = truncated or any(overlaps(touched, a, b) for a, b in checked)
        loader = make_loader(ds)
        with pytest.MonkeyPatch.context() as mp:
            _booby_trap(mp)
            try:
                batches = [(list(b["key"]), b["start"].tolist(), b["x"].numpy()) for b in loader]
            except sw.ShardError as e:
                assert e.shard == f"{ds}/{shard}" and isinstance(e.offset, int), e
                assert may_fail, ("spurious ShardError", ops, e)
                return
        assert len(batches) == len(loader)
        # a corrupted magic of a member whose window 0 is read cannot pass
        read_from_0 = {k for keys, starts, _ in batches for k, s in zip(keys, starts) if s == 0}
        if not p.compressed:
            for key, off, _, _ in p.members[shard]:
                assert not (key in read_from_0 and overlaps(touched, off, off + 6)), ("bad magic went unnoticed", key, ops)
        for keys, starts, x in batches:  # verified: every window is exact, touched or not
            for i, (k, s) in enumerate(zip(keys, starts)):
                assert np.array_equal(x[i], p.seqs[k][s : s + W]), (k, s, ops)


@pytest.mark.timeout(60)
@FUZZ
@given(data=st.data())
def test_fuzz_shard_corruption(pristine, data):
    shard, ops = data.draw(corruptions(pristine))
    run_corrupted(pristine, shard, ops)


@pytest.mark.timeout(60)
@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_fuzz_zstd_shard_corruption(pristine_zstd, data):
    shard, ops = data.draw(corruptions(pristine_zstd))
    run_corrupted(pristine_zstd, shard, ops)


def test_tar_header_corruption_fails_its_chunk_and_is_never_read_unverified(pristine, tmp_path):
    """A damaged tar header fails its chunk's checksum; unverified, the check of its name and size fails."""
    ds = tmp_path / "ds"
    shutil.copytree(pristine.root, ds)
    shard = pristine.shards[0]
    key, off, _, _ = pristine.members[shard][0]
    touched, _ = apply(ds / shard, [("write", off - 512, b"garbage tar header!")])
    assert touched
    with pytest.MonkeyPatch.context() as mp:
        _booby_trap(mp)
        with pytest.raises(sw.ShardError, match="tar header here is of member 'garbage tar header!'") as e:
            sum(1 for _ in make_loader(ds, read=sw.Read(verify_checksums=False)))
        assert e.value.member == f"{key}.npy" and e.value.offset == off
        with pytest.raises(sw.ShardError, match="checksum mismatch") as e:
            sum(1 for _ in make_loader(ds))
    assert e.value.member == f"{key}.npy" and e.value.offset < 4096


# -- parse_npy_header -------------------------------------------------------------------------------

def _valid_header(shape=(7, 3), descr="<f4") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


TOKENS = ["{", "}", "(", ")", "[", "]", ",", ":", " ", "'descr'", "'shape'", "'fortran_order'", "True", "False",
          "None", "'<f4'", "'|O'", "'<U5'", "'V8'", "[('a', '<f4')]", "-1", "0", "3", "99999999999999999999",
          "1e400", "'", "\\", "\n", "lambda: 0", "__import__('os')", "(" * 300, "b'x'", "{'a': 1}", "'<M8[s]'",
          "'<f99999999999'", "'>c16'", "'S0'"]


@st.composite
def near_valid_headers(draw) -> bytes:
    body = "".join(draw(st.lists(st.sampled_from(TOKENS), max_size=30)))
    if draw(st.booleans()):
        body = "{'descr': %s, 'fortran_order': %s, 'shape': %s, }" % tuple(
            "".join(draw(st.lists(st.sampled_from(TOKENS), min_size=1, max_size=4))) for _ in range(3))
    raw = body.encode("latin1") + b"\n"
    version = draw(st.sampled_from([b"\x01\x00", b"\x02\x00", b"\x03\x00", b"\x01\x07", b"\x00\x00"]))
    if version[0] == 1:
        n = draw(st.one_of(st.just(len(raw)), st.integers(0, 0xFFFF)))
        head = b"\x93NUMPY" + version + n.to_bytes(2, "little")
    else:
        n = draw(st.one_of(st.just(len(raw)), st.integers(0, 0xFFFFFFFF)))
        head = b"\x93NUMPY" + version + n.to_bytes(4, "little")
    return head + raw


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(st.one_of(st.binary(max_size=200), near_valid_headers(),
                 st.builds(lambda h, i, b: h[:i] + b + h[i + len(b):], st.just(_valid_header()),
                           st.integers(0, 127), st.binary(min_size=1, max_size=8))))
def test_fuzz_parse_npy_header(data):
    with pytest.MonkeyPatch.context() as mp:
        _booby_trap(mp)
        try:
            dtype, shape, hlen = npyfmt.parse_npy_header(data)
        except ValueError:
            return
    # whatever parses is a plain numeric C-order array header that fits in the bytes given
    assert dtype.kind in "biufc" and not dtype.hasobject
    assert 10 <= hlen <= len(data)
    assert all(isinstance(d, int) for d in shape)


def test_parse_npy_header_accepts_what_numpy_writes():
    for shape, descr in [((7, 3), "<f4"), ((0,), "<i8"), ((5, 2, 2), "|u1"), ((1,), "<c16")]:
        dtype, got_shape, hlen = npyfmt.parse_npy_header(_valid_header(shape, descr))
        assert (dtype, got_shape, hlen) == (np.dtype(descr), shape, len(_valid_header(shape, descr)))
    with pytest.raises(ValueError, match="object"):
        npyfmt.parse_npy_header(_valid_header((3,), "|O"))


# -- states and manifests: every field checked before use ----------------------------------------------

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=8),
                 st.just(1.9), st.just(10**9), st.just(-5), st.just(2**60), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.just([[[[[[[[1]]]]]]]]))
ALLOWED_STATE = (sw.StateMismatchError,)


@pytest.fixture(scope="module")
def state_case(pristine):
    loader = make_loader(pristine.root)
    it = iter(loader)
    for _ in range(3):
        next(it)
    return pristine, loader.state_dict(), len(loader)


def _paths(obj, prefix=()):
    """Every (path to a value) of a nested dict/list."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    import copy

    out = copy.deepcopy(obj)
    if not path:
        return value
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


@pytest.mark.timeout(120)
@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_fuzz_state_dict_fields(state_case, data):
    """A state with any one field replaced loads (then yields a whole epoch's rest) or is a StateMismatchError."""
    p, state, n = state_case
    path = data.draw(st.sampled_from(list(_paths(state))))
    bad = _set(state, path, data.draw(JUNK))
    loader = make_loader(p.root)
    try:
        loader.load_state_dict(bad)
    except ALLOWED_STATE as e:
        assert "state" in str(e) or "plan inputs differ" in str(e), e
        return
    got = sum(1 for _ in loader)
    assert got <= n


@pytest.mark.parametrize("field, value", [("epoch", 1.9), ("epoch", None), ("batches", 10**9), ("batches", -1),
                                          ("batches", 2.0), ("inputs", None), ("version", None),
                                          ("rest_of", [{"inputs": None, "batches": 1}])])
def test_a_damaged_state_is_refused_naming_the_field(state_case, field, value):
    p, state, _ = state_case
    with pytest.raises(sw.StateMismatchError) as e:
        make_loader(p.root).load_state_dict({**state, field: value})
    assert field in str(e.value) or "version" in str(e.value)


@functools.cache
def _bomb() -> str:
    import base64
    import zlib

    return base64.b64encode(zlib.compress(b"\0" * (64 << 20), 9)).decode()


@pytest.mark.timeout(120)
@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_fuzz_manifest_fields(pristine, data, tmp_path_factory):
    """index.json with any one field replaced (or a column's bytes swapped for junk) loads or is a ManifestError;
    never an IndexError, KeyError, MemoryError, RecursionError or ZeroDivisionError."""
    import base64
    import json
    import zlib

    doc = json.loads((pristine.root / "index.json").read_text())
    path = data.draw(st.sampled_from(list(_paths(doc))))
    kind = data.draw(st.sampled_from(["junk", "bomb", "column"]))
    if kind == "bomb":  # 64 KB that inflate to 64 MB
        value = _bomb()
    elif kind == "column":
        value = base64.b64encode(zlib.compress(data.draw(st.binary(max_size=200)))).decode()
    else:
        value = data.draw(JUNK)
    text = json.dumps(_set(doc, path, value))
    try:
        m = sw.formats.manifest.parse_manifest(text)
    except sw.ManifestError:
        return
    assert m.num_sequences >= 0


# -- states that contradict themselves: refused naming the key, never resumed, never advice about arguments ------

@pytest.fixture(scope="module")
def elastic_state(pristine):
    """A state of an elastic resume: taken on 1 rank after 2 batches of a 2-rank job (its run is in rest_of)."""
    two = make_loader(pristine.root, rank=0, world_size=2)
    it = iter(two)
    for _ in range(2):
        next(it)
    one = make_loader(pristine.root)
    one.load_state_dict(two.state_dict())
    it = iter(one)
    for _ in range(2):
        next(it)
    state = one.state_dict()
    assert state["rest_of"][0]["inputs"]["world_size"] == 2 and state["inputs"]["canonical"] == [8, 1]
    return pristine, state, len(one)


def _edit(state, edits, sealed=True):
    out = copy.deepcopy(state)
    for path, value in edits:
        out = _set(out, path, value)
    if not sealed:
        del out["check"]  # as a state saved before states carried a check
    return out


RUN = ("rest_of", 0, "inputs")
CONTRADICTIONS = [  # (edits, the key the error names, whether a state without its check is refused too)
    ([(("inputs", "world_size"), 3)], "fields inputs.world_size (3) and inputs.canonical ([8, 1])", True),
    ([(RUN + ("canonical",), [7, 1])], "fields rest_of[0].inputs.world_size (2) and rest_of[0].inputs.canonical", True),
    ([(RUN + ("canonical",), [8, 3]), (RUN + ("num_workers",), 2)], "rest_of[0].inputs.num_workers (2)", True),
    ([(RUN + ("seed",), 1)], "field rest_of[0].inputs.seed is 1, inputs.seed is 0", True),
    ([(RUN + ("window",), 4)], "field rest_of[0].inputs.window is 4", True),
    ([(RUN + ("canonical",), [8, 7])], "field rest_of[0] does not match the check", False),  # plausible: the check
    ([(("rest_of", 0, "batches"), 1)], "field rest_of[0] does not match the check", False),
    ([(("batches",), 3)], "field epoch or batches does not match the check", False),
    ([(("inputs", "world_size"), 2)], "field inputs does not match the check", False),
]


@pytest.mark.parametrize("sealed", [True, False])
@pytest.mark.parametrize("edits, named, unsealed_too", CONTRADICTIONS)
def test_a_state_that_contradicts_itself_is_refused_naming_the_key(elastic_state, edits, named, unsealed_too, sealed):
    p, state, _ = elastic_state
    if not sealed and not unsealed_too:
        pytest.skip("a plausible edit of a state without its check is its own word (a state saved before checks)")
    loader = make_loader(p.root)
    with pytest.raises(sw.StateMismatchError) as e:  # before: "pass canonical=(...) to WindowDataset", or resumed
        loader.load_state_dict(_edit(state, edits, sealed))
    text = str(e.value)
    assert named in text and "not a usable streamwin loader state" in text, text
    assert "pass " not in text and "WindowDataset" not in text, text  # a damaged state, not advice on arguments
    loader.load_state_dict(state)  # the state itself resumes
    assert sum(1 for _ in loader) > 0


PLAUSIBLE = st.one_of(JUNK, st.sampled_from([0, 1, 2, 3, 4, 7, 8, 14, [8, 7], [14, 1], [8, 1], [1, 1], [16, 2], True,
                                             "drop", "pad", "0123456789abcdef"]))


@pytest.mark.timeout(120)
@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_fuzz_an_edited_elastic_state_is_never_resumed(elastic_state, data):
    """Any one field of a saved state replaced by another value (junk, or one a state could hold) is refused, naming
    a field: the fields are checked, then against each other, then against the check saved with them."""
    import json

    p, state, _ = elastic_state
    path = data.draw(st.sampled_from(list(_paths(state))))
    bad = _set(state, path, data.draw(PLAUSIBLE))
    if json.dumps(bad, sort_keys=True, default=str) == json.dumps(state, sort_keys=True, default=str):
        return  # the same state
    with pytest.raises(sw.StateMismatchError) as e:
        make_loader(p.root).load_state_dict(bad)
    assert "field" in str(e.value) or "plan inputs differ" in str(e.value) or "not a streamwin loader state" in str(
        e.value), e.value


@pytest.mark.timeout(120)
@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_fuzz_position_inputs_of_a_state_without_its_check(elastic_state, data):
    """A state without a check (as saved before checks) with its world, workers, batch size or canonical streams
    edited loads or is a StateMismatchError: never the plan's advice about arguments, never more batches than an
    epoch's rest."""
    p, state, n = elastic_state
    where = data.draw(st.sampled_from([("inputs",), RUN]))
    name = data.draw(st.sampled_from(["world_size", "num_workers", "batch_size", "canonical"]))
    value = data.draw(st.sampled_from([[8, 7], [14, 1], [8, 1], [16, 2], [4, 4]]) if name == "canonical" else
                      st.integers(0 if name == "num_workers" else 1, 16))
    loader = make_loader(p.root)
    try:
        loader.load_state_dict(_edit(state, [(where + (name,), value)], sealed=False))
    except sw.StateMismatchError as e:
        assert "field" in str(e) and "pass " not in str(e), e
        return
    assert sum(1 for _ in loader) <= 4 * n  # bounded (another batch size deals the rest in other batches)
