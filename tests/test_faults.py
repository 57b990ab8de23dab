"""Every fault ends every affected request in Failed with a reason, within its deadline:
nothing hangs, nothing is written outside the request, no room is left held."""

from __future__ import annotations

import time

import pytest

from kvbridge.deploy.cluster import Result, run
from kvbridge.model.spec import CacheSpec, DType, attention_layer
from runtime_cases import DENSE8, job

P2_D1 = ("tp=2,page=4", "tp=1,page=4")


def failed_with(result: Result, role: str, *words: str) -> None:
    ranks = result.of(role)
    assert ranks, f"no {role} rank reported"
    for r in ranks:
        assert not r.error, r.error
        assert set(r.states.values()) == {"FAILED"}, (r.rank, r.states)
        for reason in r.failures.values():
            assert all(w in reason for w in words), reason


def decode_clean(result: Result) -> None:
    """Failed requests wrote nothing: the pools hold only canary bytes; rooms released."""
    for r in result.of("decode"):
        assert r.bytes_ok, r.mismatch
        assert r.released and r.active_rooms == 0


@pytest.mark.slow  # rank processes; waits out a deadline
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_notice_dropped_fails_at_the_deadline_naming_what_is_owed(transport: str) -> None:
    t0 = time.monotonic()
    res = run(
        job(
            DENSE8,
            *P2_D1,
            transport,
            chunks=3,
            prefill_settings={"faults": "drop_notice=2"},
            decode_settings={"transfer_timeout": 3.0},
        )
    )
    failed_with(res, "decode", "deadline", "still owed", "kv (", "KVBRIDGE_TRANSFER_TIMEOUT is 3 s")
    assert time.monotonic() - t0 < 60


@pytest.mark.slow  # rank processes: the fast tier's are in-process
@pytest.mark.parametrize("fault", ["dup_notices", "reorder_notices"])
def test_duplicated_or_reordered_notices_are_harmless(fault: str) -> None:
    res = run(job(DENSE8, *P2_D1, "tcp", chunks=4, prefill_settings={"faults": fault}))
    for r in res.ranks:
        assert set(r.states.values()) == {"SUCCESS"}, (r.role, r.failures)
    decode_clean(res)


@pytest.mark.slow  # rank processes: the fast tier's are in-process
def test_malformed_messages_are_refused_and_requests_still_succeed() -> None:
    res = run(job(DENSE8, *P2_D1, "shm", requests=3, decode_settings={"faults": "malformed"}))
    for r in res.ranks:
        assert set(r.states.values()) == {"SUCCESS"}, (r.role, r.failures)
    decode_clean(res)


@pytest.mark.slow  # rank processes: the fast tier's are in-process
def test_out_of_range_page_ids_from_a_peer_fail_before_any_write() -> None:
    res = run(job(DENSE8, *P2_D1, "shm", decode_settings={"faults": "bad_pages"}))
    failed_with(res, "decode", "bad_input", "out of range")
    failed_with(res, "prefill", "bad_input", "out of range")
    decode_clean(res)


@pytest.mark.slow  # rank processes: the fast tier's are in-process
def test_a_sender_that_raises_fails_the_receiver_at_once_with_its_reason() -> None:
    res = run(
        job(
            DENSE8,
            *P2_D1,
            "shm",
            prefill_settings={"faults": "sender_raise"},
            decode_settings={"transfer_timeout": 30.0},
        )
    )
    failed_with(res, "decode", "sender_error", "injected fault")
    # "at once": long before the 30 s transfer deadline
    assert all(r.seconds < 15 for r in res.of("decode"))
    decode_clean(res)


@pytest.mark.slow  # rank processes: the fast tier's are in-process
def test_incompatible_decode_is_refused_at_registration_saying_what_differs() -> None:
    other = CacheSpec("dense8", tuple(attention_layer(8, 16, DType.BFLOAT16) for _ in range(4)))
    res = run(
        job(
            DENSE8,
            *P2_D1,
            "shm",
            decode_spec=other,
            prefill_sends=False,
            prefill_settings={"waiting_timeout": 3.0},
        )
    )
    failed_with(res, "decode", "incompatible", "layer 0", "heads=8x8", "heads=8x16")


@pytest.mark.slow  # rank processes; waits out a deadline
def test_bootstrap_down_fails_within_the_bootstrap_deadline() -> None:
    t0 = time.monotonic()
    res = run(
        job(
            DENSE8,
            *P2_D1,
            "shm",
            bootstrap_down=True,
            prefill_sends=False,
            decode_settings={"bootstrap_timeout": 2.0},
        )
    )
    failed_with(res, "decode", "bootstrap", "127.0.0.1:1", "KVBRIDGE_BOOTSTRAP_TIMEOUT is 2 s")
    assert time.monotonic() - t0 < 40


@pytest.mark.slow  # rank processes: the fast tier's are in-process
def test_integrity_mode_catches_corrupted_bytes_naming_layer_and_rank() -> None:
    res = run(
        job(
            DENSE8,
            *P2_D1,
            "tcp",
            settings={"integrity": True},
            prefill_settings={"faults": "corrupt"},
        )
    )
    failed_with(res, "decode", "integrity", "region L", "prefill rank")


@pytest.mark.slow  # rank processes; waits out the heartbeat window
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_prefill_killed_during_transfer_fails_decode_within_heartbeat_window(
    transport: str,
) -> None:
    res = run(
        job(
            DENSE8,
            *P2_D1,
            transport,
            prefill_settings={"faults": "exit_after_post=1"},
            decode_settings={"transfer_timeout": 30.0},
        )
    )
    failed_with(res, "decode")
    reasons = " ".join(res.of("decode")[0].failures.values())
    assert "peer_dead" in reasons or "transport" in reasons, reasons
    assert res.of("decode")[0].seconds < 15
    assert all(r.released and r.active_rooms == 0 for r in res.of("decode"))


@pytest.mark.slow  # rank processes; waits out a deadline
def test_prefill_killed_before_registering_fails_decode_at_bootstrap() -> None:
    res = run(
        job(
            DENSE8,
            *P2_D1,
            "shm",
            kill_prefill={0: 0.0},
            decode_settings={"bootstrap_timeout": 3.0},
            prefill_settings={"waiting_timeout": 3.0},
        )
    )
    failed_with(res, "decode", "bootstrap")


@pytest.mark.slow  # rank processes: the fast tier's are in-process
def test_prefill_killed_after_the_transfer_leaves_the_result_intact() -> None:
    res = run(job(DENSE8, *P2_D1, "shm", kill_prefill_when_done=(1,)))
    for r in res.of("decode"):
        assert set(r.states.values()) == {"SUCCESS"}
        assert r.bytes_ok


@pytest.mark.slow  # rank processes; waits out the heartbeat window
def test_decode_killed_fails_the_prefill_senders_within_heartbeat_window() -> None:
    res = run(
        job(
            DENSE8,
            *P2_D1,
            "shm",
            kill_decode_when_ready=(0,),
            send_delay=3.0,
            prefill_settings={"transfer_timeout": 30.0, "waiting_timeout": 30.0},
        )
    )
    failed_with(res, "prefill", "peer_dead")
    assert all(r.seconds < 15 for r in res.of("prefill"))
    assert all(r.active_rooms == 0 for r in res.of("prefill"))


@pytest.mark.slow  # rank processes: the fast tier's are in-process
def test_a_peer_killed_on_this_host_is_dead_at_once_not_after_the_heartbeat_window() -> None:
    """A 60 s heartbeat window (300 beats of 0.2 s): the decode rank killed, the prefill
    ranks see its process gone two beats later and fail their senders, naming the exit."""
    res = run(
        job(
            DENSE8,
            *P2_D1,
            "shm",
            kill_decode_when_ready=(0,),
            send_delay=3.0,
            prefill_settings={
                "heartbeat_misses": 300,
                "transfer_timeout": 30.0,
                "waiting_timeout": 30.0,
            },
        )
    )
    failed_with(res, "prefill", "peer_dead", "exited")
    assert all(r.seconds < 20 for r in res.of("prefill"))
    assert all(r.active_rooms == 0 for r in res.of("prefill"))


@pytest.mark.slow  # rank processes: the fast tier's are in-process
def test_a_prefill_exited_on_this_host_fails_the_decode_at_once_not_after_the_window() -> None:
    """The decode side of the above: a prefill rank that exits right after posting its first
    write, a 60 s heartbeat window on the decode; it names the exit well before the window."""
    res = run(
        job(
            DENSE8,
            *P2_D1,
            "tcp",
            prefill_settings={"faults": "exit_after_post=1"},
            decode_settings={"heartbeat_misses": 300, "transfer_timeout": 30.0},
        )
    )
    failed_with(res, "decode", "peer_dead", "exited")
    assert res.of("decode")[0].seconds < 20


def test_a_faults_file_switches_a_running_ranks_faults_at_its_next_request(tmp_path) -> None:
    """``KVBRIDGE_FAULTS=@PATH``: the file's faults, read again at the start of each request
    where it changed (counters restart); a file that is not there means none; one that does not
    parse is refused at start-up and ignored later, the faults before it kept."""
    from kvbridge.config import SettingsError
    from kvbridge.runtime.faults import Faults

    path = tmp_path / "faults"
    faults = Faults.from_setting(f"@{path}")
    assert faults.shift_bytes == 0  # not there yet: none
    path.write_text("shift_bytes=4,exit_after_post=2\n")
    assert faults.shift_bytes == 0  # read at a request's start, not before
    faults.refresh()
    assert (faults.shift_bytes, faults.exit_after_post) == (4, 2)
    assert faults.posting() == 1  # counted from the switch
    path.write_text("no_such_fault")
    faults.refresh()
    assert faults.shift_bytes == 4  # a typo later: logged, the faults before it kept
    path.write_text("")
    faults.refresh()
    assert (faults.shift_bytes, faults.exit_after_post, faults.posting()) == (0, 0, 0)
    path.write_text("no_such_fault")
    with pytest.raises(SettingsError, match="faults file .*unknown fault 'no_such_fault'"):
        Faults.from_setting(f"@{path}")
    assert Faults.from_setting("shift_bytes=8").shift_bytes == 8  # a list, as before
