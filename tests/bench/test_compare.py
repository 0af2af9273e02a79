"""The comparison against another OpenAI-compatible server (llama.cpp's llama-server in
`bench/llamacpp_cpu.sh`): `serving --compare-base-url` sends the same requests to both and prints the
ratio, and `gapless.bench.compare` reads a folder of runs into the same table."""

from __future__ import annotations

import json

from gapless.bench import compare, serving
from tests.bench.test_serving import MODEL, fake, fake_server  # noqa: F401  (fixtures)


def test_compare_base_url_sends_the_same_requests_and_prints_the_ratio(fake, tmp_path, capsys):  # noqa: F811
    url, state = fake
    argv = ["--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--range-ratio", "0.5"]
    argv += [
        "--base-url",
        url,
        "--compare-base-url",
        url + "/v1",
        "--compare-model",
        "other",
        "--disable-tqdm",
    ]
    res = serving.main([*argv, "--output-json", str(tmp_path / "s.json")])
    first, second = state.bodies[:6], state.bodies[6:]
    assert len(second) == 6
    assert sorted(b["prompt"] for b in first) == sorted(b["prompt"] for b in second)
    assert sorted(b["max_tokens"] for b in first) == sorted(b["max_tokens"] for b in second)
    assert {b["model"] for b in first} == {MODEL} and {b["model"] for b in second} == {"other"}
    other = res["compare"]
    assert other["base_url"] == url and other["model"] == "other"
    assert (
        other["summary"]["completed"] == 6
        and other["summary"]["output_tokens"] == res["summary"]["output_tokens"]
    )
    want = res["summary"]["output_throughput"] / other["summary"]["output_throughput"]
    out = capsys.readouterr().out
    assert f"{want:.2f}x |" in out and "| 1.00x |" in out
    assert json.loads((tmp_path / "s.json").read_text())["compare"]["ratio"] == other["ratio"]


def _summary(tput: float, completed: int = 4) -> dict:
    stat = dict(mean=1.0, std=0.0, p50=10.0, p90=11.0, p99=12.0)
    return dict(completed=completed, failed=0, output_throughput=tput, ttft_ms=stat, tpot_ms=stat)


def test_compare_reads_a_folder_of_runs(tmp_path):
    for engine, c, tput in [("llama.cpp-F32", 1, 40.0), ("gapless", 1, 36.0), ("gapless", 8, 130.0)]:
        (tmp_path / f"{engine}_c{c}.summary.json").write_text(json.dumps({"summary": _summary(tput)}))
    (tmp_path / "llama.cpp-F32_c8.summary.json").write_text(json.dumps({"summary": _summary(0.0, 0)}))
    out = compare.main([str(tmp_path)])
    c1, c8 = out.split("concurrency 8")
    # gapless first, the numerator of every ratio; a run with nothing completed has no ratio
    assert c1.index("| gapless |") < c1.index("| llama.cpp-F32 |")
    assert "| llama.cpp-F32 | 4/4 | 40.0 | 10 | 10.0 | 0.90x |" in c1
    assert "| llama.cpp-F32 | 0/0 | 0.0 | 10 | 10.0 | -x |" in c8


def test_compare_sets_each_file_beside_llamacpp_on_the_same_file(tmp_path):
    runs = [("gapless-Q4_1", 1, 60.0), ("llama.cpp-Q4_1", 1, 120.0), ("gapless-Q4_1", 8, 300.0)]
    runs += [("llama.cpp-Q4_1", 8, 200.0), ("gapless-F32", 1, 50.0), ("llama.cpp-Q8_0", 1, 100.0)]
    for engine, c, tput in runs:
        (tmp_path / f"{engine}_c{c}.summary.json").write_text(json.dumps({"summary": _summary(tput)}))
    out = compare.main([str(tmp_path)])
    table = out[out.index("| same file") :]
    assert "| 1 requests | 8 requests |" in table
    assert "| gapless-Q4_1 vs llama.cpp-Q4_1 | 60.0 vs 120.0 = 0.50x | 300.0 vs 200.0 = 1.50x |" in table
    # a file only one engine served has no row
    assert "gapless-F32" not in table and "Q8_0" not in table
