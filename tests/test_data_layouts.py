"""Three of the local layouts users keep train for 2 steps as users launch them (DDP, 2 processes): a save_to_disk
DatasetDict with named splits (--dataset_split train_sft,test_sft), a folder of parquet shards, and a gzip-compressed
jsonl file, the last with --no-packing (one example per row). Every layout is prepared in process, with its data line,
in tests/test_data_sources.py."""

from __future__ import annotations

import pytest
from test_data_sources import write_layout

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FLAGS = ("--max_steps", "2", "--seq_len", "64", "--per_device_batch_size", "1", "--eval_fraction", "0.25",
         "--eval_every", "2", "--max_new_tokens", "0", "--report_to", "none")


@pytest.mark.parametrize("layout, line", [
    ("save_to_disk_dict", "(train: 'train_sft', eval: 'test_sft'), 24 train / 6 eval examples"),
    ("parquet_shards", "(train: 'train', eval: 0.25 of 'train' held out), 18 train / 6 eval examples"),
    ("jsonl_gz", "(train: 'train', eval: 0.25 of 'train' held out), 18 train / 6 eval examples -> 18 / 6 rows of 64 "
                 "tokens, one example each (--no-packing)"),
])
def test_a_local_layout_trains(runs, session_root, layout, line):
    root = session_root / f"layout-{layout}"
    root.mkdir()
    dataset, split = write_layout(root, layout)
    packing = ("--no-packing",) if layout == "jsonl_gz" else ()
    run = runs(f"layout-{layout}", *FLAGS, *packing, "--dataset", dataset,
               *(("--dataset_split", split) if split else ()), config="ddp").check()
    assert line in run.output
    assert [m["step"] for m in run.metrics()] == [1, 2] and run.summary()["eval_loss"] is not None
