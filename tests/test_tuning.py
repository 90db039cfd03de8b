"""Tuning convolution tiles: candidates measured on a real board (a device
server process behind a real tracker, or an emulated arm64 board under
qemu), the cache they leave, and modules built from it checked against
onnxruntime."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import crosscompile
import minirt
from crosscompile import tuning
from crosscompile.gemm import tile_for
from crosscompile.schedule import ConvShape, candidate_tiles, default_tile
from crosscompile.target import resolve_target
from remote import rpc
from remote.errors import TetherError
from remote.client.tuning import tune
from tests.onnx_models import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = resolve_target("host")
# The three distinct GEMM convolution shapes of conv_net(); the second runs twice.
SHAPES = ["x1x3x10x10-w16x3x3x3-s1x1-p1x1x1x1-d1x1-g1",
          "x1x16x10x10-w16x16x3x3-s1x1-p1x1x1x1-d1x1-g1",
          "x1x16x10x10-w24x16x1x1-s1x1-p0x0x0x0-d1x1-g1"]


def conv_net(seed=0):
    """conv3x3(3->16) relu conv3x3(16->16) relu conv3x3(16->16) relu conv1x1(16->24)."""
    rng = np.random.default_rng(seed)

    def weight(name, shape):
        return numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32), name)

    inits = [weight("w1", (16, 3, 3, 3)), weight("w2", (16, 16, 3, 3)),
             weight("w3", (16, 16, 3, 3)), weight("w4", (24, 16, 1, 1)),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b1")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("Conv", ["r3", "w4"], ["y"])]
    graph = helper.make_graph(nodes, "conv_net",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 10, 10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24, 10, 10])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def feeds(shape=(1, 3, 10, 10), seed=3):
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def expected_best(entry, unit="s"):
    """The fastest (or, counted, cheapest) candidate by median, unless the
    default (measured first) is within tuning.MIN_GAIN of it."""
    median = f"median_{unit}"
    fastest = min(entry["candidates"], key=lambda c: c[median])
    default = entry["candidates"][0]
    assert default["tile"] == entry["default"]
    if fastest[median] < default[median] * (1 - tuning.MIN_GAIN):
        return fastest["tile"]
    return default["tile"]


def run_host(lib, tmp_path, inputs, name="net.so"):
    path = lib.export_library(str(tmp_path / name))
    module = minirt.load(path)
    try:
        return module.run(inputs)
    finally:
        module.close()


@pytest.fixture(scope="module")
def tuned(farm, tmp_path_factory):
    """conv_net tuned on the farm's host board into a fresh cache: (result, cache)."""
    cache = tuning.TuningCache(tmp_path_factory.mktemp("tuning"))
    with rpc.connect_tracker(*farm.tracker).request("host", timeout=60) as sess:
        result = tune(conv_net(), "host", sess, cache=cache, number=3, repeat=3)
        address = sess.address
    return result, cache, address


def test_tuning_on_a_board_caches_each_conv_shape_with_its_fastest_tile(tuned):
    result, cache, address = tuned
    entries = cache.entries(HOST)
    assert sorted(entries) == sorted(SHAPES)
    assert [s.shape.key for s in result.shapes] == SHAPES and not any(s.cached for s in result.shapes)
    for key, entry in entries.items():
        m = entry["gemm"][0]
        measured = [c["tile"] for c in entry["candidates"]]
        shape = ConvShape.from_dict(entry["shape"])
        assert measured == [t.spec for t in candidate_tiles(HOST, m, shape)]
        assert len(measured) >= 4
        for c in entry["candidates"]:
            assert "error" not in c, c
            assert len(c["samples_s"]) == 3 and c["median_s"] == pytest.approx(np.median(c["samples_s"]))
        assert entry["best"] == expected_best(entry)
        assert entry["default"] == default_tile(HOST, shape).spec
        assert entry["device"]["address"] == address
    # The 3x3 convolutions default to the transposed tile, the 16-deep 1x1 to tile_for's.
    assert [len(entries[key]["default"]) for key in SHAPES] == [3, 3, 2]
    # The file on disk holds the same, under the normalised target.
    with open(result.cache_path) as f:
        data = json.load(f)
    assert data["target"] == {"triple": HOST.triple, "cpu": HOST.cpu, "features": HOST.features}
    assert data["entries"] == entries


def test_tuned_shapes_are_skipped_unless_forced(tuned, farm):
    _, cache, _ = tuned
    before = {k: e["measured"] for k, e in cache.entries(HOST).items()}
    fresh = tuning.TuningCache(cache.directory)  # reads the file again
    again = tune(conv_net(), "host", None, cache=fresh, number=1, repeat=1)
    assert all(s.cached for s in again.shapes)
    assert {k: e["measured"] for k, e in fresh.entries(HOST).items()} == before
    assert [s.best for s in again.shapes] == [tuple(cache.entries(HOST)[k]["best"]) for k in SHAPES]


def test_build_with_the_cache_uses_the_tuned_tiles_and_matches_onnxruntime(tuned, tmp_path):
    _, cache, _ = tuned
    lib = crosscompile.build(conv_net(), "host", schedules=cache)
    tiles = lib.metadata["gemm_tiles"]
    assert len(tiles) == 4 and all(t["tuned"] for t in tiles)
    for t in tiles:
        assert t["tile"] == cache.entries(HOST)[t["shape"]]["best"]
    assert lib.summary["tuned_convs"] == lib.summary["gemm_convs"] == 4
    inputs = feeds()
    np.testing.assert_allclose(run_host(lib, tmp_path, inputs)[0], reference(conv_net(), inputs)[0],
                               rtol=1e-4, atol=1e-4)
    default = crosscompile.build(conv_net(), "host")
    assert not any(t["tuned"] for t in default.metadata["gemm_tiles"])


def test_a_forced_tile_changes_the_module_and_stays_correct(tmp_path):
    cache = tuning.TuningCache(tmp_path / "cache")
    default = tile_for(HOST)
    forced = next(t for t in candidate_tiles(HOST) if t.mr != default.mr)
    for key in SHAPES:
        cache.put(HOST, key, {"best": forced.spec})
    lib = crosscompile.build(conv_net(), "host", schedules=cache)
    plain = crosscompile.build(conv_net(), "host")
    assert {tuple(t["tile"]) for t in lib.metadata["gemm_tiles"]} == {tuple(forced.spec)}
    assert lib.so_bytes != plain.so_bytes
    inputs = feeds()
    np.testing.assert_allclose(run_host(lib, tmp_path, inputs)[0], reference(conv_net(), inputs)[0],
                               rtol=1e-4, atol=1e-4)


def test_entries_tuned_against_another_default_are_ignored(tmp_path):
    """A cache written when the compiler's default tile for a shape was
    another one measured its candidates against that: the build keeps
    today's default rather than a choice that was never compared with it."""
    cache = tuning.TuningCache(tmp_path / "cache")
    rows = tile_for(HOST)
    for key in SHAPES:
        cache.put(HOST, key, {"best": rows.spec, "default": [rows.mr + 2, rows.nv]})
    lib = crosscompile.build(conv_net(), "host", schedules=cache)
    plain = crosscompile.build(conv_net(), "host")
    assert [t["tile"] for t in lib.metadata["gemm_tiles"]] == [t["tile"] for t in plain.metadata["gemm_tiles"]]
    assert not any(t["tuned"] for t in lib.metadata["gemm_tiles"])
    assert any(len(t["tile"]) == 3 for t in lib.metadata["gemm_tiles"])  # not the entries' rows tile


ODD_SHAPES = [
    # 13 output channels (a partial row block), 4x5 = 20 output pixels (a
    # partial column panel), asymmetric padding, stride 2.
    ConvShape((1, 5, 9, 11), (13, 5, 3, 3), (1, 13, 5, 5), (2, 2), (1, 0, 1, 1), (1, 1), 1),
    # Two groups of 7 output channels, dilated, 1-D of 37 pixels.
    ConvShape((2, 6, 37), (14, 3, 3), (2, 14, 33), (1,), (0, 0), (2,), 2),
]


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: s.key)
def test_every_candidate_tile_computes_the_same_convolution(shape, tmp_path):
    model = tuning.conv_model(shape)
    inputs = feeds(shape.x)
    want = reference(model, inputs)[0]
    assert want.shape == shape.y
    tiles = candidate_tiles(HOST, shape.gemm[0], shape)
    assert len(tiles) >= 4 and sum(1 for t in tiles if t.pixels) >= 2
    for tile in tiles:
        lib = crosscompile.build(model, "host", schedules={shape.key: tile.spec})
        assert [t["tile"] for t in lib.metadata["gemm_tiles"]] == [tile.spec]
        got = run_host(lib, tmp_path, inputs, f"{tile.label}.so")[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4,
                                   err_msg=f"tile {tile.label}")


def test_a_corrupt_cache_file_names_itself_and_says_to_delete_it(tmp_path):
    # The directory `tether` uses with TETHER_CACHE=tmp_path.
    cache = tuning.TuningCache(tmp_path / "tuning")
    path = cache.path_for(HOST)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write('{"schema": "tether.tuning/1", "entries": {"x1')
    with pytest.raises(tuning.TuningCacheError) as info:
        crosscompile.build(conv_net(), "host", schedules=cache)
    assert path in str(info.value) and "delete it" in str(info.value)
    # The command says the same and fails cleanly.
    model = tmp_path / "net.onnx"
    onnx.save(conv_net(), str(model))
    env = {**os.environ, "PYTHONPATH": ROOT, "TETHER_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "remote.cli", "compile", str(model), "-o",
                           str(tmp_path / "net.so")], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "corrupt" in proc.stderr and os.path.basename(path) in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "remote.cli", "compile", str(model), "-o",
                           str(tmp_path / "net.so"), "--no-tuning"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "default register tiles for 4 GEMM convolutions" in proc.stdout


def _table(stdout):
    """Rows of `tether tune`'s table as dicts by header."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("SHAPE"))
    headers = re.split(r"\s{2,}", lines[start].strip())
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("cache: "):
            break
        rows.append(dict(zip(headers, re.split(r"\s{2,}", line.strip()))))
    return rows


def test_tether_tune_command_against_a_farm(farm, tmp_path):
    model = tmp_path / "net.onnx"
    onnx.save(conv_net(), str(model))
    env = {**os.environ, "PYTHONPATH": ROOT, "TETHER_CACHE": str(tmp_path / "cache")}
    host, port = farm.tracker

    def tether(*args):
        return subprocess.run([sys.executable, "-m", "remote.cli", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    proc = tether("tune", str(model), "--target", "host", "--key", "host", "--tracker",
                  f"{host}:{port}", "--number", "2", "--repeat", "2")
    assert proc.returncode == 0, proc.stderr
    rows = _table(proc.stdout)
    assert [r["SHAPE"] for r in rows] == SHAPES
    cache_line = proc.stdout.strip().splitlines()[-1]
    path = cache_line.split("cache: ", 1)[1]
    assert path.startswith(str(tmp_path / "cache" / "tuning"))
    with open(path) as f:
        entries = json.load(f)["entries"]
    for row in rows:
        entry = entries[row["SHAPE"]]
        assert row["BEST"] == "x".join(map(str, entry["best"]))
        assert row["DEFAULT"] == "x".join(map(str, entry["default"]))
        assert row["GEMM MxKxN"] == "x".join(map(str, entry["gemm"]))
        assert float(row["SPEED-UP"].rstrip("x")) == pytest.approx(
            float(row["DEFAULT MS"]) / float(row["BEST MS"]), rel=0.05)
    # Run again: nothing is measured, every row says so; --json carries the candidates.
    proc = tether("tune", str(model), "--key", "host", "--tracker", f"{host}:{port}", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [s["shape"] for s in data["shapes"]] == SHAPES and all(s["cached"] for s in data["shapes"])
    assert all(len(s["candidates"]) >= 4 for s in data["shapes"])
    # `tether compile` picks the cache up for the target.
    proc = tether("compile", str(model), "-o", str(tmp_path / "net.so"))
    assert proc.returncode == 0, proc.stderr
    assert f"tuned register tiles for 4 of 4 GEMM convolutions (cache {path})" in proc.stdout


def test_tuning_an_x86_target_without_a_board_says_what_to_do(tmp_path):
    """Instructions are counted on emulated ARM cores only: another x86
    machine must be tuned on itself or on a board of it."""
    with pytest.raises(TetherError, match=r"x86_64-unknown-linux-gnu.*is not ARM.*--target host.*--key"):
        tune(conv_net(), "x86_64-unknown-linux-gnu/znver3", None, cache=tuning.TuningCache(tmp_path))
    assert not os.listdir(tmp_path)


@pytest.mark.emulated
@pytest.mark.bookworm_arm64
def test_tether_tune_counts_instructions_where_the_farm_has_no_board_of_the_key(farm, tmp_path):
    """`tether tune --key rasp4b64` against a farm without such a board costs
    each tile by the instructions one run executes on an emulated
    Cortex-A72, says so, and caches the cheapest tile, which builds use."""
    from deploy_recipes import emulate
    from tests.emulated_boards import skip_without_tools

    skip_without_tools()
    root = emulate.build_rootfs("bookworm", "arm64")
    # A private cache for the tuning table, sharing the root filesystems
    # already built (a second debootstrap would only cost minutes).
    os.makedirs(tmp_path / "cache")
    os.symlink(os.path.dirname(root), tmp_path / "cache" / "rootfs")
    shape = ConvShape((1, 8, 6, 6), (12, 8, 3, 3), (1, 12, 6, 6), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    model = tmp_path / "conv.onnx"
    onnx.save(tuning.conv_model(shape, seed=5), str(model))
    env = {**os.environ, "PYTHONPATH": ROOT, "TETHER_CACHE": str(tmp_path / "cache")}
    host, port = farm.tracker
    proc = subprocess.run([sys.executable, "-m", "remote.cli", "tune", str(model), "--key", "rasp4b64",
                           "--tracker", f"{host}:{port}"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "no board of key 'rasp4b64' is in the farm" in proc.stderr + proc.stdout
    assert "emulated cortex-a72 core" in proc.stderr + proc.stdout
    [row] = _table(proc.stdout)
    path = proc.stdout.strip().splitlines()[-1].split("cache: ", 1)[1]
    with open(path) as f:
        entry = json.load(f)["entries"][shape.key]
    target = resolve_target("rasp4b64")
    assert entry["cost"] == "instructions" and entry["device"]["cpu_model"] == "qemu cortex-a72"
    assert [c["tile"] for c in entry["candidates"]] == [t.spec for t in candidate_tiles(target, 12, shape)]
    assert not [c for c in entry["candidates"] if "error" in c]
    counts = [c["samples_instructions"] for c in entry["candidates"]]
    assert all(len(c) == 1 and c[0] > 0 for c in counts), counts
    # Different tiles execute different code: the counts are not all one number.
    assert len({c[0] for c in counts}) > 1, counts
    assert entry["best"] == expected_best(entry, "instructions")
    assert row["BEST"] == "x".join(map(str, entry["best"]))
    assert float(row["BEST M INSTR"]) == pytest.approx(
        min(c["median_instructions"] for c in entry["candidates"] if c["tile"] == entry["best"]) / 1e6,
        abs=1e-4)
    lib = crosscompile.build(str(model), target, schedules=tuning.TuningCache(tmp_path / "cache" / "tuning"))
    assert [t["tile"] for t in lib.metadata["gemm_tiles"]] == [entry["best"]]


@pytest.mark.emulated
@pytest.mark.bookworm_arm64
def test_tuning_on_an_emulated_arm64_board(tmp_path):
    """One small convolution tuned for rasp4b64 on an emulated arm64 board;
    every candidate's output agrees there, and the tuned module matches
    onnxruntime."""
    from deploy_recipes import emulate
    from tests.emulated_boards import local_farm, running_board, skip_without_tools

    skip_without_tools()
    emulate.build_rootfs("bookworm", "arm64")
    shape = ConvShape((1, 8, 6, 6), (12, 8, 3, 3), (1, 12, 6, 6), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    model = tuning.conv_model(shape, seed=5)
    target = resolve_target("rasp4b64")
    cache = tuning.TuningCache(tmp_path)
    # Counted first, as without a board; the board's timing then replaces the count.
    counted = tune(model, target, None, cache=cache)
    assert counted.shapes[0].unit == "instructions" and not counted.shapes[0].cached
    with local_farm() as farm, running_board(farm, "bookworm", "arm64", "tune-arm64"):
        with rpc.connect_tracker(*farm.tracker).request("tune-arm64", timeout=120) as sess:
            result = tune(model, target, sess, cache=cache, number=2, repeat=2,
                                 timeout=120)
            entry = cache.get(target, shape.key)
            assert [s.shape.key for s in result.shapes] == [shape.key]
            assert result.shapes[0].unit == "s" and not result.shapes[0].cached
            assert "cost" not in entry and all("median_s" in c for c in entry["candidates"])
            assert entry["device"]["machine"] == "aarch64"
            assert [c["tile"] for c in entry["candidates"]] == \
                [t.spec for t in candidate_tiles(target, 12, shape)]
            assert not [c for c in entry["candidates"] if "error" in c]
            assert entry["best"] == expected_best(entry)
            lib = crosscompile.build(model, target, schedules=cache)
            assert [t["tile"] for t in lib.metadata["gemm_tiles"]] == [entry["best"]]
            sess.upload(lib.so_bytes, target="tuned.so")
            inputs = feeds(shape.x)
            got = sess.load_module("tuned.so").run(inputs, timeout=120)[0]
    np.testing.assert_allclose(got, reference(model, inputs)[0], rtol=1e-4, atol=1e-4)


def test_a_table_of_timed_and_counted_shapes_gives_each_value_its_unit():
    """Counting keeps shapes a board timed before: the table then carries
    milliseconds and instruction counts side by side, each value with its
    unit; a table of one kind names it in the headers."""
    from remote.cli import tune as tune_cli
    from remote.client.tuning import ShapeTuning, TuningResult

    first = ConvShape((1, 8, 6, 6), (12, 8, 3, 3), (1, 12, 6, 6), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    second = ConvShape((1, 12, 6, 6), (16, 12, 1, 1), (1, 16, 6, 6), (1, 1), (0, 0, 0, 0), (1, 1), 1)
    timed = ShapeTuning(first, (8, 3), (8, 2), 2e-4, 1e-4, True, {}, "s")
    counted = ShapeTuning(second, (8, 3), (8, 3), 2e5, 2e5, False, {}, "instructions")
    target = resolve_target("rasp4b64")
    mixed = TuningResult(target, "cache.json", [timed, counted])
    assert tune_cli.headers(mixed)[4:6] == ("DEFAULT", "BEST")
    rows = tune_cli.result_rows(mixed)
    assert rows[0][4:] == ("0.2000 ms", "0.1000 ms", "2.00x", "(cached)")
    assert rows[1][4:] == ("0.2000 M instr", "0.2000 M instr", "1.00x", "")
    only = TuningResult(target, "cache.json", [counted])
    assert tune_cli.headers(only)[4:6] == ("DEFAULT M INSTR", "BEST M INSTR")
    assert tune_cli.result_rows(only)[0][4:6] == ("0.2000", "0.2000")
