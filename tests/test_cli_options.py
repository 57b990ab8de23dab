"""No option value of any ``kvbridge`` command escapes as a traceback: each bad one is refused
with exactly one line on stderr that names the option, and exit status 2.

The cases are generated from a table of (command, option, bad values), plus, for every option
that takes a value, the option given with none, an unknown option per command, and
hypothesis-made garbage for the side grammar (``--prefill``) and demo topologies. The bulk run
``main(argv)`` in this process; a handful run the real command in a subprocess.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.cli import main
from kvbridge.cli.options import MAX_NEW_TOKENS, MAX_PROMPT
from kvbridge.memory.device import cuda_unavailable
from kvbridge.planner.sidespec import LIMITS, MAX_TOKENS
from tiers import examples

SRC = Path(__file__).resolve().parents[1] / "src"
PLAN = ("plan", "--model", "qwen3-32b")
PROXY = ("proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2")
NOT_LOCAL = "192.0.2.1"  # TEST-NET-1: never this host's address, so binding fails at once

HUGE = str(10**15)
INTS = ["0", "-1", HUGE, "abc", "", "1.5", "9" * 5000]  # bad wherever a count >= 1 is asked
COUNTS = ["", ",", "0", "-5", "abc", "1,x", HUGE, f"4096,{MAX_TOKENS + 1}", "1.5"]
ROUNDS = ["0", "-1", "1001", HUGE, "abc", ""]
SIDE = [
    "",
    ",",
    " ",
    "tp",
    "tp=",
    "tp=0",
    "tp=-4",
    f"tp={LIMITS['tp'][1] + 1}",
    "tp=abc",
    "tp=4.5",
    "tp=٤",
    "tp=4,tp=2",
    "page=0",
    "page=-16",
    f"page={10**12}",
    "page=" + "9" * 5000,
    "pages=0",
    "pages=1",
    f"pages={10**12}",
    "pp=0",
    "pp=-2",
    "pp=1000000",
    "pp=1+",
    "pp=a+b",
    "pp=0+64",
    "pp=20+20",
    "pp=" + "+".join(["1"] * 2000),
    "layout=xyz",
    "layout=",
    "swa=maybe",
    "foo=1",
    "tp=3",
    "tp=2->tp=1",
    "\x00",
    "tp=4;page=16",
]
# --model files: name -> content ({dir} is a temporary directory holding them)
FILES = {
    "bad.json": "{not json",
    "list.json": "[1, 2]",
    "empty.json": "{}",
    "binary.json": b"\xff\xfe\x00garbage".decode("latin-1"),
    "unknown.json": '{"model_type": "nosuch"}',
    "zero-heads.json": '{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, '
    '"num_attention_heads": 0}',
}
MODELS = ["", "nosuch-model", "/nonexistent/config.json", "{dir}", *(f"{{dir}}/{n}" for n in FILES)]

NO_CUDA = cuda_unavailable() is not None
TABLE: list[tuple[tuple[str, ...], str, list[str]]] = [
    (PLAN, "--model", MODELS),
    (PLAN, "--prefill", SIDE),
    (PLAN, "--decode", SIDE),
    (PLAN, "--tokens", [*INTS, str(MAX_TOKENS + 1)]),
    (("bench",), "--tokens", COUNTS),
    (("bench",), "--layers", ["0", "-1", "abc", "", "100000"]),
    (("bench",), "--transports", ["", ",", "foo", "shm,shm", "shm,foo"]),
    (("bench",), "--repeat", ROUNDS),
    (("bench",), "--warmup", ["-1", "1001", HUGE, "abc", ""]),
    (("bench",), "--model", ["", "nosuch-model", "{dir}/bad.json"]),
    (("bench",), "--max-descriptors", ["-1", "abc", ""]),
    (("bench",), "--plot", ["", "/nonexistent/dir/x.png", "{dir}"]),
    (("bench", "plan"), "--tokens", [*INTS, str(MAX_TOKENS + 1)]),
    (("bench", "plan"), "--model", ["", "nosuch-model"]),
    (("bench", "plan"), "--repeat", ROUNDS),
    (("bench", "plan"), "--page", ["0", "-1", str(10**12), "abc", ""]),
    (("bench", "transfer"), "--tokens", COUNTS),
    (("bench", "transfer"), "--layers", ["0", "-1", "abc", "100000"]),
    (("bench", "transfer"), "--transports", ["", "inproc", "foo", "tcp,tcp"]),
    (("bench", "transfer"), "--repeat", ROUNDS),
    (("bench", "transfer"), "--warmup", ["-1", "1001", "abc"]),
    (("bench", "transfer"), "--model", ["", "nosuch-model"]),
    (("bench", "transfer"), "--page", ["0", "-1", str(10**12), "abc", ""]),
    (("bench", "latency"), "--tokens", COUNTS),
    (("bench", "latency"), "--transports", ["", "inproc", "foo", "tcp,tcp"]),
    (("bench", "latency"), "--repeat", ROUNDS),
    (("bench", "latency"), "--page", ["0", "-1", str(10**12), "abc", ""]),
    (("demo",), "--model", ["", " ", "nosuch-model", "/nonexistent/config.json", "."]),
    (
        ("demo",),
        "--topology",
        [
            "",
            "nosuch",
            "->",
            "tp=2->",
            "->tp=1",
            "a->b->c",
            "tp=0->tp=1",
            "tp=2,page=0->tp=1",
            "tp=1->tp=1->tp=2",
            "tp=1->foo=1",
            f"tp=1,pp={10**9}->tp=1",
        ],
    ),
    (("demo",), "--transport", ["", "udp", "inproc", "cudaipc"]),  # cudaipc: no --device
    # cuda, where this machine has none: refused, saying why
    (("demo",), "--device", ["", "gpu", "cuda:x", "cuda:-1", *(["cuda"] if NO_CUDA else [])]),
    (("demo",), "--prompt", ["", "x" * (MAX_PROMPT + 1)]),
    (("demo",), "--new-tokens", ["0", "1", "-1", str(MAX_NEW_TOKENS + 1), HUGE, "abc", ""]),
    (("demo",), "--timeout", ["0", "-1", "abc", "", "nan", HUGE]),
    (("chaos",), "--requests", INTS),
    (("chaos",), "--round", [*INTS[:-1], "1025"]),
    (("chaos",), "--seed", ["-1", str(2**64), "abc", "", "1.5"]),
    (("chaos",), "--transport", ["", "udp", "inproc"]),
    (("chaos",), "--faults", ["", ",", "nosuch", "kill_prefill,nosuch"]),
    (("bootstrap",), "--host", ["", " ", "local host", "\x00"]),
    (("bootstrap",), "--port", ["-1", "65536", "abc", "", HUGE]),
    (("bootstrap",), "--token", ["", "a b", "tök", "\n"]),
    (
        ("proxy", "--decode", "http://127.0.0.1:2"),
        "--prefill",
        [
            "",
            "localhost:8100",
            "ftp://x",
            "http://",
            "http://a b",
            "http://a:99999",
            "http://a?x=1",
        ],
    ),
    (("proxy", "--prefill", "http://127.0.0.1:1"), "--decode", ["", "nosuch"]),
    (PROXY, "--host", ["", " "]),
    (PROXY, "--port", ["0", "65536", "abc", ""]),
    (PROXY, "--timeout", ["0", "-1", "nan", "inf", "abc", "", "1e9"]),
    (PROXY, "--prefill-bootstrap", ["", "host", ":80", "h:port", "http://h:80"]),
]
# Every command, with what it needs so that only the option under test is wrong.
COMMANDS = [
    PLAN,
    ("models",),
    ("bench",),
    ("bench", "plan"),
    ("bench", "transfer"),
    ("bench", "latency"),
    ("demo",),
    ("chaos",),
    ("bootstrap",),
    PROXY,
]


def _cases() -> list[tuple[list[str], str]]:
    out = []
    for cmd, option, values in TABLE:
        out += [([*cmd, option, v], option) for v in values]
        out.append(([*cmd, option], option))  # the value missing
    out += [([*cmd, "--bogus", "1"], "--bogus") for cmd in COMMANDS]
    out += [
        (["--bogus"], "--bogus"),
        (["plan"], "--model"),
        (["proxy"], "--prefill"),
        # values fine alone, refused together (the option blamed is the one named)
        ([*PLAN, "--tokens", str(MAX_TOKENS), "--prefill", "page=1"], "--prefill"),
        ([*PLAN, "--tokens", "4096", "--decode", "tp=1,pages=8"], "--decode"),
        (["bench", "transfer", "--tokens", str(MAX_TOKENS), "--layers", "64"], "--layers"),
        (
            [*PROXY, "--prefill-bootstrap", "h:1", "--prefill-bootstrap", "h:2"],
            "--prefill-bootstrap",
        ),
    ]
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("configs")
    for name, text in FILES.items():
        (d / name).write_bytes(text.encode("latin-1"))
    return d


def run(argv: list[str]) -> tuple[int | str | None, str, str]:
    """``kvbridge argv`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as e, redirect_stdout(out), redirect_stderr(err):
        main(argv, prog_name="kvbridge")
    return e.value.code, out.getvalue(), err.getvalue()


def assert_refused(code: object, out: str, err: str, *options: str) -> None:
    assert "Traceback" not in out + err, err
    assert code == 2, (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvbridge: error: "), err
    assert any(o in lines[0] for o in options), (options, lines[0])


@pytest.mark.timeout(60)  # a bad value taken for good would start a server or a benchmark
@pytest.mark.parametrize(("argv", "option"), _cases(), ids=lambda v: repr(v)[:60])
def test_a_bad_option_is_one_line_and_exit_status_2(
    argv: list[str], option: str, files: Path
) -> None:
    argv = [a.replace("{dir}", str(files)) for a in argv]
    assert_refused(*run(argv), option)


GRAMMAR = st.sampled_from(
    [
        "tp",
        "pp",
        "page",
        "pages",
        "layout",
        "swa",
        "=",
        "=",
        ",",
        "+",
        "-",
        "->",
        "0",
        "1",
        "3",
        "16",
        "9" * 25,
        "nhd",
        "hnd",
        "yes",
        " ",
        "\t",
        "\n",
        "é",
        "٤",
        "\x00",
        ".",
        "e5",
        "_",
    ]
)
GARBAGE = st.lists(st.one_of(GRAMMAR, st.text(max_size=3)), max_size=14).map("".join)


@settings(max_examples=examples(120), deadline=None)
@given(text=GARBAGE)
def test_garbage_side_options_never_escape(text: str) -> None:
    # --tokens 0 after it: whether or not the side parses, nothing is planned
    assert_refused(*run([*PLAN, f"--prefill={text}", "--tokens", "0"]), "--prefill", "--tokens")


@settings(max_examples=examples(60), deadline=None)
@given(prefill=GARBAGE, decode=GARBAGE)
def test_garbage_demo_topologies_never_escape(prefill: str, decode: str) -> None:
    # --new-tokens 1 after it: nothing is ever run
    argv = ["demo", f"--topology={prefill}->{decode}", "--new-tokens", "1"]
    assert_refused(*run(argv), "--topology", "--new-tokens")


def test_valid_options_still_work() -> None:
    code, out, err = run(
        [*PLAN, "--prefill", "tp=4,page=16", "--decode", "tp=1,page=16", "--tokens", "64", "--json"]
    )
    assert code == 0 and err == "" and '"total_bytes"' in out


def test_a_config_with_absurd_layer_count(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        '{"model_type": "llama", "num_hidden_layers": 1000000000000, '
        '"hidden_size": 64, "num_attention_heads": 4}'
    )
    assert_refused(*run([*PLAN[:2], str(path)]), "--model")


# ---- the real command, in a subprocess --------------------------------------------------------

SUBPROCESS = [
    (["-m", "kvbridge", *PLAN, "--prefill", "tp=4,page=0"], "--prefill"),
    (["-m", "kvbridge.cli", "demo", "--topology", "tp=2->"], "--topology"),
    (["-m", "kvbridge", "bootstrap", "--host", NOT_LOCAL, "--port", "0"], "--host"),
    (["-m", "kvbridge", *PROXY, "--host", NOT_LOCAL, "--port", "8999"], "--host"),
    (
        ["-m", "kvbridge", "bench", "transfer", "--tokens", str(MAX_TOKENS), "--layers", "64"],
        "--layers",
    ),
]


def _subprocess(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.slow  # starts processes: the fast tier's are in-process
@pytest.mark.parametrize(
    ("args", "option"), SUBPROCESS, ids=[" ".join(a[1:4]) for a, _ in SUBPROCESS]
)
def test_the_real_command_refuses_in_one_line(args: list[str], option: str) -> None:
    done = _subprocess(args)
    assert_refused(done.returncode, done.stdout, done.stderr, option)


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_the_real_command_plans_valid_options() -> None:
    done = _subprocess(
        ["-m", "kvbridge", *PLAN, "--prefill", "tp=4,page=16", "--decode", "tp=1,page=16"]
    )
    assert done.returncode == 0, done.stderr
    assert "total" in done.stdout and done.stderr == ""


# ---- KVBRIDGE_* variables ------------------------------------------------------------------

BAD_SETTINGS = [
    ("KVBRIDGE_HEARTBEAT_INTERVAL", "abc", "KVBRIDGE_HEARTBEAT_INTERVAL='abc': expected a float"),
    ("KVBRIDGE_TRANSFER_TIMEOUT", "-1", "transfer_timeout must be > 0 seconds"),
    ("KVBRIDGE_STAGING", "bogus", "expected auto or always or never"),
    ("KVBRIDGE_HOST", "0.0.0.0", "set KVBRIDGE_ADVERTISE"),
]


@pytest.mark.timeout(60)  # taken for good, the command would start ranks
@pytest.mark.parametrize(
    ("name", "value", "expected"), BAD_SETTINGS, ids=[b[0] for b in BAD_SETTINGS]
)
@pytest.mark.parametrize(
    "argv",
    [["demo", "--model", "qwen3"], ["chaos"], ["bench", "transfer"], ["bench"]],
    ids=" ".join,
)
def test_a_bad_setting_is_refused_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], name: str, value: str, expected: str
) -> None:
    """Every rank a command starts reads the KVBRIDGE_* variables; a value they would refuse
    is refused once, by the command, in one line naming the variable (each rank would have
    failed its requests on its own, and the demo called them mismatches)."""
    monkeypatch.setenv(name, value)
    code, out, err = run(argv)
    assert_refused(code, out, err, name)
    assert out == "" and expected in err


@pytest.mark.slow  # a demo case's processes, started and stopped: some 10 s
def test_the_demo_timeout_reaches_its_cases() -> None:
    """``kvbridge demo --timeout 3`` gives a case's processes 3 s to answer, not the default
    60: with every prefill rank stopped before its first write (a test-only fault, through the
    environment as a user sets kvbridge's variables), the case fails naming 3 s, well before a
    minute, and says where each rank that could answer was waiting."""
    argv = ["-m", "kvbridge.cli", "demo", "--model", "qwen3", "--topology", "tp2-tp1"]
    env = {**os.environ, "PYTHONPATH": str(SRC), "KVBRIDGE_FAULTS": "stop_before_post=1"}
    done = subprocess.run(
        [sys.executable, *argv, "--transport", "shm", "--new-tokens", "2", "--timeout", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "no result within 3 s" in out, out
    # What the case waited on, asked of the ranks still able to answer: the decode rank
    # waits for its request, which both prefill ranks owe every token (the stopped prefill
    # ranks cannot write their stacks).
    assert "--- decode rank 0" in out and "in wait" in out and "receiver.py" in out, out
    flat = " ".join(out.split())  # the table's console wraps long lines
    assert "prefill rank 0 owes kv (0/" in flat and "prefill rank 1 owes kv (0/" in flat, out
