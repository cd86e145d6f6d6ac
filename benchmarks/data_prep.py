"""Memory of data preparation against the size of the corpus, this checkout and (optionally) another side by side.

    git worktree add /tmp/before c45ba18     # the preparation before rows were streamed (one batch of lists)
    python benchmarks/data_prep.py --output_dir runs/data_prep --before /tmp/before [--num_proc 1,2]

Writes synthetic text corpora (jsonl, one document a line, the tests' generator) of --docs documents each, then
prepares each one in a fresh process with a fresh datasets cache, one process per (checkout, corpus): the bundled
tokenizer, --seq_len 256, 1% held out, this checkout at each --num_proc (the other at 1: it has no workers).
Measured: the rise of anonymous resident memory (`RssAnon` of the process and its workers, sampled every 2 ms from
/proc; memory-mapped files are page cache and do not count) from just before preparing to its peak, per byte of
text, and the throughput (MB of text per second of preparation). At --num_proc 1 this checkout also times the
tokenizer calls: the rest (reading, packing, writing: the main process's one sequential pass) bounds the throughput
any --num_proc can reach. And, in a fresh process as any rank that did not prepare, the rise of opening the prepared
rows and the number of record batches of train.arrow. Prints a table and writes data_prep.json.
Units: MB = 1e6 bytes, seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Run in a child process: imports the checkout under test (its zero_utils), prepares, prints one JSON line.
CHILD = r"""
import json, os, sys, time
tree, corpus, num_proc = sys.argv[1], sys.argv[2], int(sys.argv[4])
sys.path.insert(0, tree)
sys.path.insert(0, os.path.join(sys.argv[3], "tests", "scripts"))
from types import SimpleNamespace
from harness import _RssAnonPeak
from transformers import AutoTokenizer
import datasets  # imported before the probe under both checkouts
tokenizer = AutoTokenizer.from_pretrained(os.path.join(tree, "zero_utils", "assets", "tiny-llama"))
one_process = SimpleNamespace(is_main_process=True, num_processes=1)
tokenizing = None  # seconds in the tokenizer, timed at --num_proc 1 (all of it in this process)
info = None  # the preparation's summary (checkouts that have it)


def timed(work):  # `work`, its seconds added to `tokenizing`
    def run(*args):
        begin = time.perf_counter()
        done = work(*args)
        tokenizing[0] += time.perf_counter() - begin
        return done
    return run


start = time.perf_counter()
with _RssAnonPeak() as probe:
    flat = os.path.exists(os.path.join(tree, "zero_utils", "data.py"))  # 0.1: the modules in one folder
    if flat and not os.path.exists(os.path.join(tree, "zero_utils", "prepared_rows.py")):  # before streamed preparation
        from zero_utils import data
        data.build_sft_datasets(one_process, tokenizer, corpus, 256, 0.01, 0, vocab_size=len(tokenizer))
    elif os.path.exists(os.path.join(tree, "zero_utils", "data", "preparation.py")):  # one pipeline (0.4 on)
        from zero_utils.data.preparation import prepare
        from zero_utils.data.sft_rows import SFTRows
        if num_proc == 1:  # time the tokenizing share
            tokenizing, SFTRows.make = [0.0], timed(SFTRows.make)
        *_, info = prepare(one_process, tokenizer, corpus, SFTRows(256, tokenizer.pad_token_id or 0),
                           eval_fraction=0.01, seed=0, num_proc=num_proc)
    else:
        if os.path.exists(os.path.join(tree, "zero_utils", "data", "prepared_rows.py")):  # folders by concern (0.2 on)
            from zero_utils.data import prepared_rows
        else:  # 0.1: the modules in one folder
            from zero_utils import prepared_rows
        workers = {"num_proc": num_proc} if hasattr(prepared_rows, "default_num_proc") else {}
        if num_proc == 1 and hasattr(prepared_rows, "_tokenize_chunk"):  # time the tokenizing share
            tokenizing, prepared_rows._tokenize_chunk = [0.0], timed(prepared_rows._tokenize_chunk)
        *_, info = prepared_rows.prepare_rows(one_process, tokenizer, corpus, seq_len=256, eval_fraction=0.01,
                                              seed=0, column_map=None, pad_token_id=tokenizer.pad_token_id or 0,
                                              **workers)
seconds = time.perf_counter() - start
print(json.dumps({"rss_anon_rise_bytes": probe.peak - probe.before, "seconds": seconds,
                  **({"seconds_not_tokenizing": seconds - tokenizing[0]} if tokenizing else {}),
                  **({"folder": info["folder"]} if info else {})}))
"""

# Run in another child process: what a rank that only reads the rows pays to open them (the checkout's open_rows).
OPEN_CHILD = r"""
import json, os, sys
from pathlib import Path
tree, folder = sys.argv[1], sys.argv[3]
sys.path.insert(0, tree)
sys.path.insert(0, os.path.join(sys.argv[2], "tests", "scripts"))
import pyarrow
from harness import rss_anon_bytes
if os.path.exists(os.path.join(tree, "zero_utils", "data", "sft_rows.py")):  # one pipeline (0.4 on)
    from zero_utils.data.sft_rows import open_rows
elif os.path.exists(os.path.join(tree, "zero_utils", "data", "prepared_rows.py")):  # folders by concern (0.2 on)
    from zero_utils.data import prepared_rows
    open_rows = prepared_rows.open_rows
else:  # 0.1: the modules in one folder
    from zero_utils import prepared_rows
    open_rows = prepared_rows.open_rows
import datasets  # imported before measuring, as the recipe has
before = rss_anon_bytes()
rows = open_rows(Path(folder))
opened = rss_anon_bytes() - before
with pyarrow.memory_map(os.path.join(folder, "train.arrow")) as source:
    batches = sum(1 for _ in pyarrow.ipc.open_stream(source))
print(json.dumps({"open_rss_anon_rise_bytes": opened, "train_record_batches": batches}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="runs/data_prep")
    parser.add_argument("--before", help="another checkout to measure side by side (e.g. a git worktree)")
    parser.add_argument("--docs", default="1100,11000", help="documents per corpus, comma-separated "
                        "(default: about 4 MB and 40 MB of text)")
    parser.add_argument("--num_proc", default="1,2", help="tokenizing processes of this checkout, comma-separated")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "tests"))
    from test_prepared_rows import write_corpus

    corpora = [write_corpus(out / f"corpus_{n}.jsonl", int(n)) for n in args.docs.split(",")]
    trees = {"this checkout": REPO, **({"before": Path(args.before).resolve()} if args.before else {})}
    results = []
    for name, tree in trees.items():
        for num_proc in args.num_proc.split(",") if name == "this checkout" else ["1"]:
            for corpus in corpora:
                env_home = out / "hf_home" / f"{name.replace(' ', '_')}_{corpus.stem}_{num_proc}"
                proc = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(corpus), str(REPO), num_proc],
                                      text=True, capture_output=True, env={**_env(), "HF_HOME": str(env_home)})
                if proc.returncode:
                    raise SystemExit(f"{name} on {corpus.name} failed:\n{proc.stderr[-3000:]}")
                row = {"checkout": name, "num_proc": int(num_proc), "text_bytes": corpus.stat().st_size,
                       **json.loads(proc.stdout.splitlines()[-1])}
                if "folder" in row:  # what every other rank holds for the rows: opened in a fresh process
                    opened = subprocess.run([sys.executable, "-c", OPEN_CHILD, str(tree), str(REPO),
                                             row.pop("folder")],
                                            text=True, capture_output=True, env=_env(), check=True)
                    row.update(json.loads(opened.stdout.splitlines()[-1]))
                row["rss_per_text_byte"] = row["rss_anon_rise_bytes"] / row["text_bytes"]
                row["text_mb_per_s"] = row["text_bytes"] / 1e6 / row["seconds"]
                results.append(row)
                print(f"{name:<14} num_proc {num_proc} {row['text_bytes'] / 1e6:6.1f} MB of text: RssAnon rise "
                      f"{row['rss_anon_rise_bytes'] / 1e6:8.1f} MB ({row['rss_per_text_byte']:.2f} B per byte), "
                      f"{row['seconds']:5.1f} s, {row['text_mb_per_s']:.2f} MB/s", flush=True)
                if "train_record_batches" in row:
                    print(f"{'':<14} opening the rows (another rank): RssAnon rise "
                          f"{row['open_rss_anon_rise_bytes'] / 1e6:.1f} MB, {row['train_record_batches']} record "
                          "batches", flush=True)
                if "seconds_not_tokenizing" in row:  # the one main process's share: reading, packing, writing
                    row["main_process_mb_per_s"] = row["text_bytes"] / 1e6 / row["seconds_not_tokenizing"]
                    print(f"{'':<14} of which not tokenizing {row['seconds_not_tokenizing']:5.1f} s: at most "
                          f"{row['main_process_mb_per_s']:.2f} MB/s with any --num_proc", flush=True)
    (out / "data_prep.json").write_text(json.dumps(results, indent=1) + "\n")


def _env() -> dict:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "TQDM_DISABLE": "1"}


if __name__ == "__main__":
    main()
