"""Dataset mixtures in alignment-handbook's format, in process: how many examples each source gives and which
(against `datasets`' own shuffle, as alignment-handbook draws them), and every bad input as one sentence where the
flags are parsed."""

from __future__ import annotations

import runpy

import pytest
from conftest import REPO

from zero_utils.cli import parse_settings
from zero_utils.data_mixture import check_mixture, drawn_indices, mixture_in_file
from zero_utils.errors import UserError

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
    assert drawn_indices(1000, 0.3, seed=42) == drawn_indices(1000, 0.3, seed=42)
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
    assert "learning_rate, model_name_or_path ignored" in capsys.readouterr().out  # an alignment-handbook recipe
    (tmp_path / "run.yaml").write_text("lr: 1.0e-4\n" + MIXTURE)
    cfg = parse_settings(settings, ["--config", str(tmp_path / "run.yaml")])
    assert cfg.dataset == str(tmp_path / "run.yaml") and cfg.lr == 1e-4


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
