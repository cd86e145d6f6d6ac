"""The suite's launch ledger and its scratch space: a pytest plugin (tests/conftest.py loads it).

Launches are the suite's cost (docs/TESTING.md#the-launch-budget). Every `accelerate launch` or torchrun a test
starts is counted where it starts, including those a subprocess starts (the compare CLI, benchmarks/*.py, a copied
recipe's launch, multinode, faults): tests/ledger/sitecustomize.py, first on every started process's PYTHONPATH,
appends a line per launcher and per launched process to the file ZERO_RECIPES_LAUNCH_LEDGER names. After each test
the plugin gives the lines that arrived during it to that test (tests run one at a time per pytest process; each
xdist worker has its own file). A shared run (`runs(name, ...)` in conftest) is launched by the first test that
asks for it, whichever file that is; its other readers note a read (`note_shared_run`). So a file's count is what
it needs, whatever ran before it and whether it runs alone: the launches made in it plus the shared runs it read
that other files made. At the end the plugin prints, per test file: tests, launches made, launches needed, budget,
processes, launch seconds and the tests' own seconds; a file that needs more than its budget in docs/TESTING.md (or
has launches and no budget) fails the run with one sentence, and so does a shared run launched twice.
`--launch-ledger PATH` keeps the ledger, one JSON line per launch (file, test, run, processes, seconds, command) and
per read of a shared run made elsewhere (file, test, run).

Nothing is left behind: every process the tests start gets TMPDIR, torch inductor's cache and wandb's folders under
pytest's temporary root for this run (`<basetemp>/scratch`), which pytest removes with the rest after a passing run.
A pytest started inside a test (to check collection, or a planted launch) runs its own ledger only when the
test clears ZERO_RECIPES_LAUNCH_LEDGER from its environment; otherwise its launches count for the outer test.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SITE = Path(__file__).resolve().parent / "ledger"  # holds sitecustomize.py, the recorder
LEDGER_FILE = "ZERO_RECIPES_LAUNCH_LEDGER"  # the raw file launched processes append to
LEDGER_DIR = "ZERO_RECIPES_LEDGER_DIR"  # where each pytest process (controller, xdist worker) keeps its files
RUN_NAME = "ZERO_RECIPES_LEDGER_RUN"  # the name of a shared run (conftest's `runs`), for the duplicate check
# The budget table: a row per test file, `| tests/<file>.py | <budget> | ...` (the first number is the budget).
BUDGET_ROW = re.compile(r"^\|\s*`?([\w/]+\.py)`?\s*\|\s*(\d+)\s*\|", re.MULTILINE)
# Its seventh column is the file's test seconds in the measured run: `| file | budget | 5 more numbers | words |`.
SECONDS_ROW = re.compile(r"^\|\s*`?([\w/]+\.py)`?\s*\|(?:\s*\d+\s*\|){5}\s*(\d+)\s*\|", re.MULTILINE)


def pytest_addoption(parser):
    group = parser.getgroup("launch ledger")
    group.addoption("--launch-budgets", default=str(REPO / "docs/TESTING.md"),
                    help="the Markdown file whose table gives each test file's launch budget (default: %(default)s)")
    group.addoption("--launch-ledger", default=None, metavar="PATH",
                    help="also write the ledger there: one JSON line per launch (file, test, processes, seconds)")


def note_shared_run(name: str) -> None:
    """Record that the running test reads the shared run `name` without launching it (tests/conftest.py's `runs`)."""
    if os.environ.get(LEDGER_FILE):
        with open(os.environ[LEDGER_FILE], "a") as f:
            f.write(json.dumps({"event": "read", "run": name}) + "\n")


def budget_table(path: str | Path) -> str:
    """The budget table's lines in the Markdown file `path`: the first table with a test file's row. Later tables
    (docs/TESTING.md's before/after per file) have rows of the same shape and must not be read as budgets."""
    table: list[str] = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("|"):
            table.append(line)
        elif table:
            if BUDGET_ROW.search("\n".join(table)):
                break
            table = []
    return "\n".join(table)


def read_budgets(path: str | Path) -> dict[str, int]:
    """{test file relative to the repository: launches allowed} from the budget table in `path`."""
    return {name: int(budget) for name, budget in BUDGET_ROW.findall(budget_table(path))}


def read_file_seconds(path: str | Path) -> dict[str, int]:
    """{test file relative to the repository: its tests' seconds in the measured run} from the budget table."""
    return {name: int(seconds) for name, seconds in SECONDS_ROW.findall(budget_table(path))}


def pytest_collection_modifyitems(session, config, items):
    """The longest files first, by the budget table's test seconds (a file missing there last), each file's tests in
    their order: two xdist workers that take whole files in this order (`--dist loadfile --no-loadscope-reorder`)
    end within about one short file of each other, not with a long file started last running alone."""
    seconds = read_file_seconds(config.getoption("launch_budgets"))
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0))  # stable: a file stays together


def scratch_environment(root: Path) -> dict[str, str]:
    """The variables that keep what tests and their processes write to temporary and cache folders under `root`."""
    folders = {"TMPDIR": "tmp", "TORCHINDUCTOR_CACHE_DIR": "inductor", "WANDB_CACHE_DIR": "wandb/cache",
               "WANDB_CONFIG_DIR": "wandb/config", "WANDB_DATA_DIR": "wandb/data",
               "WANDB_ARTIFACT_DIR": "wandb/artifacts", "MPLCONFIGDIR": "matplotlib"}
    for folder in folders.values():
        (root / folder).mkdir(parents=True, exist_ok=True)
    return {name: str(root / folder) for name, folder in folders.items()}


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path plugin has set up its factory
def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker and os.environ.get(LEDGER_FILE):
        return  # a pytest inside a test: its launches count for the test that started it
    if worker:
        folder = Path(os.environ[LEDGER_DIR])
    else:
        base = config._tmp_path_factory.getbasetemp()  # this run's root; xdist workers get folders inside it
        folder = base / "launch-ledger"
        folder.mkdir(exist_ok=True)
        os.environ.update(scratch_environment(base / "scratch"))
        tempfile.tempdir = None  # this process's own temporary files follow TMPDIR too
        os.environ[LEDGER_DIR] = str(folder)
    os.environ[LEDGER_FILE] = str(folder / f"raw-{worker or 'main'}.jsonl")
    paths = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path and path != str(SITE)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), *paths])  # xdist workers inherit the controller's
    config.pluginmanager.register(LaunchLedger(config, folder, worker), "launch_ledger_instance")


class LaunchLedger:
    """Gives each launch to the test it ran in, and on the controller sums and checks them at the end."""

    def __init__(self, config, folder: Path, worker: str | None):
        self.config, self.folder, self.worker = config, folder, worker
        self.raw = Path(os.environ[LEDGER_FILE])
        self.read_bytes = 0
        self.launches: dict[str, dict] = {}  # launch id -> its ledger line, in start order
        self.reads: list[dict] = []  # a test read a shared run it did not launch
        self.test_seconds: dict[str, float] = defaultdict(float)  # nodeid -> set-up + call + tear-down
        self.budgets: dict[str, int] = {}
        self.problems: list[str] = []
        self.table: list[tuple] = []

    def _read_new_lines(self, nodeid: str) -> None:
        if not self.raw.exists():
            return
        with self.raw.open("rb") as f:
            f.seek(self.read_bytes)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.read_bytes += len(complete)
        now = time.time()
        for line in complete.decode().splitlines():
            record = json.loads(line)
            if record["event"] == "launch":
                self.launches[record["id"]] = {
                    "file": nodeid.split("::")[0], "test": nodeid, "run": record["run"], "processes": 0,
                    "seconds": None, "started": record["time"], "command": " ".join(record["argv"])}
            elif record["event"] == "read":
                self.reads.append({"file": nodeid.split("::")[0], "test": nodeid, "run": record["run"], "read": True})
            elif record["event"] == "process" and record["launch"] in self.launches:
                self.launches[record["launch"]]["processes"] += 1
            elif record["event"] == "end" and record["id"] in self.launches:
                self.launches[record["id"]]["seconds"] = round(record["seconds"], 2)
        for launch in self.launches.values():  # a launcher killed outright writes no end: its time until now
            if launch["seconds"] is None and launch["test"] == nodeid:
                launch["seconds"] = round(now - launch["started"], 2)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        yield
        self._read_new_lines(item.nodeid)

    def pytest_runtest_logreport(self, report):
        self.test_seconds[report.nodeid] += report.duration

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        # Each pytest process writes what it gave its tests once; an xdist worker finishes before the controller,
        # which reads them all.
        with (self.folder / f"ledger-{self.worker or 'main'}.jsonl").open("w") as f:
            for line in [*self.launches.values(), *self.reads]:
                f.write(json.dumps(line) + "\n")
        if self.worker:
            return
        lines = [json.loads(line) for path in sorted(self.folder.glob("ledger-*.jsonl"))
                 for line in path.read_text().splitlines()]
        if self.config.option.launch_ledger:
            Path(self.config.option.launch_ledger).write_text("".join(json.dumps(x) + "\n" for x in lines))
        launches = [line for line in lines if not line.get("read")]
        budgets = self.budgets = read_budgets(self.config.option.launch_budgets)
        per_file: dict[str, dict] = defaultdict(lambda: {"tests": 0, "launches": 0, "needs": 0, "processes": 0,
                                                          "launch_s": 0.0, "test_s": 0.0})
        for nodeid, seconds in self.test_seconds.items():
            per_file[nodeid.split("::")[0]]["tests"] += 1
            per_file[nodeid.split("::")[0]]["test_s"] += seconds
        made_in = defaultdict(set)  # the shared runs each file launched
        for launch in launches:
            row = per_file[launch["file"]]
            row["launches"] += 1
            row["processes"] += launch["processes"]
            row["launch_s"] += launch["seconds"] or 0.0
            made_in[launch["file"]].add(launch["run"])
        read_elsewhere = defaultdict(set)  # shared runs a file read that another file launched
        for line in lines:
            if line.get("read") and line["run"] not in made_in[line["file"]]:
                read_elsewhere[line["file"]].add(line["run"])
        for name, row in per_file.items():
            row["needs"] = row["launches"] + len(read_elsewhere[name])
        self.table = sorted(per_file.items(), key=lambda item: -item[1]["test_s"])
        where = self.config.option.launch_budgets
        for name, row in self.table:
            budget = budgets.get(name)
            if row["needs"] and budget is None:
                self.problems.append(f"{name} needs {row['needs']} launches and has no launch budget in {where}: "
                                     "add its row to the table.")
            elif budget is not None and row["needs"] > budget:
                shared = len(read_elsewhere[name])
                self.problems.append(
                    f"{name} needs {row['needs']} launches ({row['launches']} made in it, {shared} of other files' "
                    f"shared runs), over its budget of {budget} in {where}: share a run or raise the budget there.")
        by_run: dict[str, list] = defaultdict(list)
        for launch in launches:
            if launch["run"]:
                by_run[launch["run"]].append(launch["test"])
        for run, tests in by_run.items():
            if len(tests) > 1:
                self.problems.append(f"the shared run {run!r} was launched {len(tests)} times ({', '.join(tests)}): "
                                     "keep the tests that read it on one xdist worker.")
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.worker or not self.table:
            return
        write = terminalreporter.write_line
        terminalreporter.section("launch ledger")
        write(f"{'test file':<36} {'tests':>5} {'launches':>8} {'needs':>5} {'budget':>6} {'processes':>9} "
              f"{'launch s':>9} {'test s':>8}")
        budgets = self.budgets
        total = defaultdict(float)
        for name, row in self.table:
            write(f"{name:<36} {row['tests']:>5} {row['launches']:>8} {row['needs']:>5} {budgets.get(name, '-')!s:>6} "
                  f"{row['processes']:>9} {row['launch_s']:>9.0f} {row['test_s']:>8.0f}")
            for key, value in row.items():
                total[key] += value
        write(f"{'total':<36} {total['tests']:>5.0f} {total['launches']:>8.0f} {'':>5} {'':>6} "
              f"{total['processes']:>9.0f} {total['launch_s']:>9.0f} {total['test_s']:>8.0f}")
        for problem in self.problems:
            terminalreporter.write_line(f"LAUNCH BUDGET: {problem}", red=True, bold=True)
