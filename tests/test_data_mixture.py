"""Dataset mixtures in alignment-handbook's format, in process: how many examples each source gives and which
(against `datasets`' own shuffle, as alignment-handbook draws them), and every bad input as one sentence where the
flags are parsed."""

from __future__ import annotations

import runpy

import pytest
from conftest import REPO

from zero_utils.data.mixture import check_mixture, drawn_indices, mixture_in_file
from zero_utils.launch.cli import parse_settings
from zero_utils.run.errors import UserError

pytestmark = pytest.mark.unit

MIXTURE = """dataset_mixture:
  datasets:
    - id: chat.jsonl
      columns: [messages]
      weight: 0.75
    - id: alpaca.json
      split: train
      weight: 0.25
  seed: 42
"""


@pytest.fixture(scope="module")
def settings():
    return runpy.run_path(str(REPO / "recipes/llama_zero3.py"), run_name="mixture_test")["Settings"]


def test_a_weight_draws_what_alignment_handbook_draws():
    """weight <= 1: int(weight x available) examples, the very ones `ds.shuffle(seed).select(range(n))` gives;
    above 1: every example floor(weight) times, and the fraction's draw; another seed, another draw."""
    from datasets import Dataset

    ds = Dataset.from_dict({"i": list(range(1000))})
    for weight in (0.25, 0.5, 0.999, 1.0):
        upstream = ds.shuffle(seed=42).select(range(int(len(ds) * weight)))["i"]
        assert drawn_indices(1000, weight, seed=42) == upstream, weight
    assert drawn_indices(1000, 0.3, seed=42) != drawn_indices(1000, 0.3, seed=43)
    assert drawn_indices(1000, 0.3, seed=42)[:8] == [978, 933, 859, 916, 127, 608, 856, 260]  # pinned: any process
    over = drawn_indices(1000, 2.5, seed=7)
    assert len(over) == 2500 and over[:2000] == list(range(1000)) * 2
    assert over[2000:] == ds.shuffle(seed=7).select(range(500))["i"]
    assert len(drawn_indices(3, 0.2, seed=0)) == 0  # int(0.6): as upstream counts


def test_a_mixture_file_or_a_config_key_names_the_data(tmp_path, settings, capsys):
    (tmp_path / "mix.yaml").write_text("model_name_or_path: x\nlearning_rate: 2.0e-5\n" + MIXTURE)
    mixture = mixture_in_file(str(tmp_path / "mix.yaml"))
    assert [(s.id, s.weight, s.split) for s in mixture.sources] == [("chat.jsonl", 0.75, "train"),
                                                                      ("alpaca.json", 0.25, "train")]
    assert mixture.sources[0].kept_columns() == ["messages"] and mixture.seed == 42
    assert capsys.readouterr().out == ""  # read quietly wherever the data is prepared
    parse_settings(settings, ["--dataset", str(tmp_path / "mix.yaml")])  # an alignment-handbook recipe as --dataset
    assert capsys.readouterr().out.count("learning_rate, model_name_or_path ignored") == 1  # once, at parsing
    (tmp_path / "run.yaml").write_text("lr: 1.0e-4\n" + MIXTURE)
    cfg = parse_settings(settings, ["--config", str(tmp_path / "run.yaml")])
    assert cfg.dataset == str(tmp_path / "run.yaml") and cfg.lr == 1e-4
    assert "ignored" not in capsys.readouterr().out  # a --config file's other keys are its flags


@pytest.mark.parametrize("mixture,flags,sentence", [
    ("dataset_mixture:\n  datasets:\n    - id: a.jsonl\n      wieght: 0.5\n", (),
     "'wieght' is not a key of a dataset mixture (did you mean 'weight'?)"),
    ("dataset_mixture:\n  datasets:\n    - id: a.jsonl\n  sed: 1\n", (), "'sed' is not a key of a dataset mixture "
                                                                          "(did you mean 'seed'?)"),
    ("dataset_mixture:\n  datasets:\n    - id: a.jsonl\n      weight: 0\n", (),
     "source 'a.jsonl' has weight 0; a weight is a positive number"),
    ("dataset_mixture:\n  datasets:\n    - id: a.jsonl\n      weight: -1\n", (),
     "has weight -1; a weight is a positive"),
    ("dataset_mixture:\n  datasets: []\n", (), "dataset_mixture has no datasets"),
    ("dataset_mixture:\n  datasets:\n    - id: a.jsonl\n", ("--dataset_split", "train_sft"),
     "--dataset_split name one data set, but --dataset"),
    ("dataset_mixture:\n  datasets:\n    - id: a.jsonl\n", ("--columns", "prompt=q", "--dataset_config", "x"),
     "--dataset_config and --columns name one data set"),
    ("dataset_mixture:\n  datasets:\n    - id: a.jsonl\n  test_split_size: 0.1\n", ("--eval_fraction", "0.2"),
     "--eval_fraction and the mixture's test_split_size both say what to hold out"),
    ("dataset_mixture:\n  datasets:\n    - id: a.jsonl\n  test_split_size: 1.5\n", (),
     "test_split_size 1.5 is neither a fraction in (0, 1) nor a count"),
])
def test_a_bad_mixture_is_one_sentence_where_the_flags_are_parsed(tmp_path, settings, mixture, flags, sentence):
    path = tmp_path / "mix.yaml"
    path.write_text(mixture)
    with pytest.raises(UserError) as error:
        parse_settings(settings, ["--dataset", str(path), *flags])
    assert sentence in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError) as in_config:  # the same mixture as a key of a --config file
        parse_settings(settings, ["--config", str(path), *flags])
    assert sentence in str(in_config.value)


def test_a_mixture_in_config_and_a_dataset_is_refused(tmp_path, settings):
    (tmp_path / "run.yaml").write_text(MIXTURE)
    with pytest.raises(UserError, match=r"--dataset and the dataset_mixture of .*run.yaml both name the data"):
        parse_settings(settings, ["--config", str(tmp_path / "run.yaml"), "--dataset", "other.jsonl"])
    (tmp_path / "both.yaml").write_text("dataset: other.jsonl\n" + MIXTURE)
    with pytest.raises(UserError, match=r"sets both dataset and dataset_mixture; keep one"):
        parse_settings(settings, ["--config", str(tmp_path / "both.yaml")])
    assert check_mixture("data.jsonl", {"dataset_split"}, True) is None  # one source: nothing to check


# ---------------------------------------------------------------------------------------------- prepared rows
def write_alpaca(path, count: int):
    import json

    path.write_text(json.dumps([{"instruction": f"Repeat the number {i}.", "input": "", "output": f"{i}"}
                                for i in range(count)]))
    return path


def mixture_file(tmp_path, name: str, sources: list[tuple[str, float, str]], seed: int = 42, test: float = 0.1):
    lines = ["dataset_mixture:", "  datasets:"]
    for path, weight, split in sources:
        lines += [f"    - id: {path}", f"      weight: {weight}", f"      split: {split}"]
    lines += [f"  seed: {seed}", f"  test_split_size: {test}"]
    (tmp_path / name).write_text("\n".join(lines) + "\n")
    return mixture_in_file(str(tmp_path / name))


def test_a_mixture_is_prepared_once_with_each_sources_draw_and_a_key_of_its_own(tmp_path):
    """Bundled chat messages (weight 0.75 of 4,000) and an Alpaca file (0.25 of 400): int(weight x available)
    examples each, both layouts in one set of rows, each source's share of the tokens; a second preparation reuses
    the rows; another weight, source, seed or split (of a save_to_disk DatasetDict) prepares others."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from zero_utils.assets import BUNDLED_DATASET, BUNDLED_MODEL
    from zero_utils.data.preparation import prepare as prepare_once
    from zero_utils.data.sft_rows import SFTRows

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    alpaca = write_alpaca(tmp_path / "alpaca.json", 400)

    def prepare(mixture):
        return prepare_once(SimpleNamespace(is_main_process=True, num_processes=1), tokenizer, mixture,
                            SFTRows(128, 0), eval_fraction=0.0, seed=0, cache_root=tmp_path / "rows", num_proc=1)

    base = [(BUNDLED_DATASET, 0.75, "train"), (str(alpaca), 0.25, "train")]
    train, evaluation, info = prepare(mixture_file(tmp_path, "m.yaml", base))
    sources = info["sources"]
    assert [(s["examples_used"], s["examples_available"]) for s in sources] == [(3000, 4000), (100, 400)]
    assert info["train_examples"] + info["eval_examples"] == 3100 and info["eval_examples"] == 310
    assert all(s["tokens"] > 0 for s in sources) and sum(s["token_share"] for s in sources) == pytest.approx(1)
    assert len(train) > 0 and evaluation is not None and not info["reused"]
    assert prepare(mixture_file(tmp_path, "again.yaml", base))[2]["reused"]
    (tmp_path / "other.json").write_text(alpaca.read_text())
    changed = [[(BUNDLED_DATASET, 0.5, "train"), base[1]],  # a weight
               [base[0], (str(tmp_path / "other.json"), 0.25, "train")]]  # a source
    folders = {prepare(mixture_file(tmp_path, f"c{i}.yaml", c))[2]["folder"] for i, c in enumerate(changed)}
    folders.add(prepare(mixture_file(tmp_path, "seed.yaml", base, seed=1))[2]["folder"])  # the seed
    from datasets import DatasetDict, load_dataset

    splits = load_dataset("json", data_files=str(alpaca), split="train")
    DatasetDict({"train": splits.select(range(200)), "validation": splits.select(range(200, 400))}).save_to_disk(
        str(tmp_path / "two_splits"))
    for split in ("train", "validation"):  # the same data set, another split: another key
        folders.add(prepare(mixture_file(tmp_path, f"{split}.yaml",
                                         [base[0], (str(tmp_path / "two_splits"), 0.25, split)]))[2]["folder"])
    assert len(folders | {info["folder"]}) == 6


@pytest.mark.distributed
@pytest.mark.slow
def test_a_mixture_trains_under_fsdp2_and_a_relaunch_reuses_its_rows(tmp_path):
    """The bundled chat messages (0.75) and an Alpaca file (0.25) as one --dataset mixture, FSDP2 on 2 ranks:
    summary.json names both sources and their shares, the data line too; a relaunch reuses the rows (2 launches)."""
    from conftest import isolated_env, launch

    from zero_utils.assets import BUNDLED_DATASET

    alpaca = write_alpaca(tmp_path / "alpaca.json", 400)
    mixture_file(tmp_path, "mix.yaml", [(BUNDLED_DATASET, 0.75, "train"), (str(alpaca), 0.25, "train")])
    env = isolated_env(tmp_path)
    args = ("--dataset", str(tmp_path / "mix.yaml"), "--max_steps", "3", "--seq_len", "128", "--max_new_tokens", "0",
            "--report_to", "none", "--per_device_batch_size", "2")
    first = launch(tmp_path / "first", *args, config="fsdp2", mixed_precision="no", env=env).check()
    again = launch(tmp_path / "again", *args, config="fsdp2", mixed_precision="no", env=env).check()
    sources = first.summary()["data"]["sources"]
    assert [(s["id"], s["examples_used"], s["examples_available"]) for s in sources] == [
        (BUNDLED_DATASET, 3000, 4000), (str(alpaca), 100, 400)]
    assert all(0 < s["token_share"] < 1 for s in sources) and first.summary()["steps"] == 3
    assert "alpaca.json (train): 100 of 400 examples" in first.output
    assert again.summary()["data"]["reused"] and "prepared rows reused from" in again.output
    assert again.metrics()[0]["loss"] == first.metrics()[0]["loss"]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_dpo_recipe_trains_on_a_mixture_of_two_pair_files(tmp_path):
    """The bundled pairs (weight 0.5) and a renamed copy of 300 of them (question/good/bad, weight 2: each pair
    twice): DDP on 2 ranks, step 1 at ln 2, summary.json names both sources (1 launch)."""
    import json
    import math

    from conftest import isolated_env, launch

    from zero_utils.assets import BUNDLED_PREFERENCES

    rows = [json.loads(line) for line in open(BUNDLED_PREFERENCES)][:300]
    (tmp_path / "renamed.jsonl").write_text("".join(json.dumps({"question": r["prompt"], "good": r["chosen"],
                                                                "bad": r["rejected"]}) + "\n" for r in rows))
    (tmp_path / "pairs.yaml").write_text(
        f"dataset_mixture:\n  datasets:\n    - id: {BUNDLED_PREFERENCES}\n      weight: 0.5\n"
        f"    - id: {tmp_path / 'renamed.jsonl'}\n      columns: {{prompt: question, chosen: good, rejected: bad}}\n"
        "      weight: 2.0\n  seed: 3\n  test_split_size: 50\n")
    run = launch(tmp_path / "dpo", "--dataset", str(tmp_path / "pairs.yaml"), "--max_steps", "2", "--max_new_tokens",
                 "0", "--report_to", "none", "--per_device_batch_size", "2", recipe="recipes/llama_dpo.py",
                 config="ddp", mixed_precision="no", env=isolated_env(tmp_path)).check()
    summary = run.summary()
    assert [(s["examples_used"], s["examples_available"]) for s in summary["data"]["sources"]] == [(1000, 2000),
                                                                                                   (600, 300)]
    assert summary["data"]["eval"]["pairs"] == 50 and run.metrics()[0]["loss"] == pytest.approx(math.log(2))
    assert "renamed.jsonl (train): 600 of 300 pairs" in run.output


def test_a_source_the_recipe_cannot_train_is_one_sentence(tmp_path):
    """A pair set in an SFT mixture, and a chat set in a DPO mixture: each ends in the one sentence the single
    --dataset gets, naming the columns found, before anything is tokenized."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from zero_utils.assets import BUNDLED_DATASET, BUNDLED_MODEL, BUNDLED_PREFERENCES
    from zero_utils.data.preparation import prepare
    from zero_utils.data.sft_rows import SFTRows
    from zero_utils.preference.pair_rows import PairRows

    one = SimpleNamespace(is_main_process=True, num_processes=1)
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    both = mixture_file(tmp_path, "both.yaml", [(BUNDLED_DATASET, 0.5, "train"), (BUNDLED_PREFERENCES, 0.5, "train")])
    with pytest.raises(UserError, match=r"chosen.*rejected|rejected.*chosen") as sft:
        prepare(one, tokenizer, both, SFTRows(128, 0), eval_fraction=0, seed=0, cache_root=tmp_path / "rows",
                num_proc=1)
    with pytest.raises(UserError, match=r"a preference set needs prompt, chosen and rejected") as dpo:
        prepare(one, tokenizer, str(tmp_path / "both.yaml"), PairRows(128), eval_fraction=0, seed=0,
                cache_root=tmp_path / "pairs", num_proc=1)
    assert "\n" not in str(sft.value) + str(dpo.value)
    assert not list((tmp_path / "rows").glob("*")) and not list((tmp_path / "pairs").glob("*"))  # nothing written


def test_each_sources_tokens_are_the_tokens_in_its_rows_after_truncation(tmp_path):
    """Issue 67 item 2: 300 chat examples of 300 words each (every one longer than --seq_len 128, so each is cut to
    its first 128 tokens) next to the bundled short ones: the long source's tokens are examples used x 128 exactly
    (counted as tokenized they were about 3x that), and the shares follow."""
    import json
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from zero_utils.assets import BUNDLED_DATASET, BUNDLED_MODEL
    from zero_utils.data.preparation import prepare
    from zero_utils.data.sft_rows import SFTRows

    words = " ".join(["paris"] * 300)
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Say paris {i} times."}, {"role": "assistant", "content": words}]}) + "\n"
        for i in range(300)))
    mixture = mixture_file(tmp_path, "m.yaml", [(BUNDLED_DATASET, 0.1, "train"), (str(tmp_path / "long.jsonl"),
                                                                                    1.0, "train")])
    _, _, info = prepare(SimpleNamespace(is_main_process=True, num_processes=1),
                         AutoTokenizer.from_pretrained(BUNDLED_MODEL), mixture, SFTRows(128, 0), eval_fraction=0.0,
                         seed=0, cache_root=tmp_path / "rows", num_proc=1)
    short, long = info["sources"]
    assert long["examples_used"] == 300 and info["truncated_examples"] == 300
    assert long["tokens"] == 300 * 128
    assert 0 < short["tokens"] < 400 * 128 and long["token_share"] == pytest.approx(
        long["tokens"] / (long["tokens"] + short["tokens"]))


def test_an_unreachable_source_is_one_sentence_naming_it_before_any_source_is_read(tmp_path):
    """Issue 67 item 2: a missing local file (source 2 of 2) and an uncached Hub data set offline (source 3 of 3),
    in an SFT mixture and in a DPO one: one sentence naming the source, its position and the mixture's file, before
    the first source is read (`load_raw_dataset` is never called). For real: an empty HF_HOME and HF_HUB_OFFLINE=1
    in a subprocess, as a compute node without network meets it. A UserError of the preparation reaches every rank
    with its sentence (`distributed.run_on_main_process`, tests/test_bad_input.py)."""
    import subprocess
    import sys

    from zero_utils.assets import BUNDLED_DATASET, BUNDLED_PREFERENCES

    for kind, bundled in (("sft", BUNDLED_DATASET), ("dpo", BUNDLED_PREFERENCES)):
        mixture_file(tmp_path, f"{kind}_missing.yaml", [(bundled, 0.5, "train"), ("data/missing.jsonl", 0.5, "train")])
        mixture_file(tmp_path, f"{kind}_hub.yaml", [(bundled, 0.5, "train"), (bundled, 0.2, "train"),
                                                    ("someorg/some_pairs", 1.0, "train")])
    code = f"""
from types import SimpleNamespace
from transformers import AutoTokenizer
from zero_utils.data import sources
from zero_utils.data.mixture import mixture_in_file
from zero_utils.data.preparation import prepare
from zero_utils.data.sft_rows import SFTRows
from zero_utils.assets import BUNDLED_MODEL
from zero_utils.preference.pair_rows import PairRows
from zero_utils.run.errors import UserError

def never(*args, **kwargs):
    raise AssertionError("a source was read")
sources.load_raw_dataset = never
one, tokenizer, root = SimpleNamespace(is_main_process=True, num_processes=1), AutoTokenizer.from_pretrained(
    BUNDLED_MODEL), {str(tmp_path)!r}
for kind in ("sft", "dpo"):
    for case in ("missing", "hub"):
        path = f"{{root}}/{{kind}}_{{case}}.yaml"
        try:
            if kind == "sft":
                prepare(one, tokenizer, mixture_in_file(path), SFTRows(128, 0), eval_fraction=0, seed=0,
                        cache_root=root + "/rows", num_proc=1)
            else:
                prepare(one, tokenizer, path, PairRows(128), eval_fraction=0, seed=0, cache_root=root + "/pairs",
                        num_proc=1)
        except UserError as error:
            print(error)
"""
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    lines = out.stdout.splitlines()
    assert len(lines) == 4, out.stdout + out.stderr[-3000:]
    for kind, (missing, hub) in zip(("sft", "dpo"), (lines[:2], lines[2:]), strict=True):
        assert missing == (f"dataset_mixture source 2 of 2 ({tmp_path}/{kind}_missing.yaml): 'data/missing.jsonl' "
                           "does not exist; give an existing local file or folder (a relative path starts at the "
                           "directory you launch from) or a Hub data set id.")
        assert hub.startswith(f"dataset_mixture source 3 of 3 ({tmp_path}/{kind}_hub.yaml): 'someorg/some_pairs' is "
                              "not in the local cache and HF_HUB_OFFLINE=1 forbids downloading it; download it ahead "
                              "with `hf download --repo-type dataset someorg/some_pairs`"), hub
