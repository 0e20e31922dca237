"""The per-backend ledger: running sums, frozen estimates, idempotent and late reports."""

from tandem.routing import Ledger, LedgerEntry, ProgressEvent


def entry(req_id: str, prompt: int = 100, cached: int = 60, max_tokens: int = 10) -> LedgerEntry:
    return LedgerEntry(req_id, num_prompt_tokens=prompt, max_tokens=max_tokens,
                       num_prefill_tokens_est=prompt - cached)


def sums(ledger: Ledger) -> tuple[int, int, int, int]:
    return ledger.num_prefill_tokens, ledger.num_decode_tokens, ledger.num_active, ledger.num_queued


def brute_force_sums(ledger: Ledger) -> tuple[int, int, int, int]:
    entries = list(ledger.entries.values())
    num_active = sum(e.status == "active" for e in entries)
    return (sum(e.num_prefill_tokens_left() for e in entries),
            sum(e.num_decode_tokens_left() for e in entries), num_active, len(entries) - num_active)


def test_queued_request_keeps_its_estimate_until_evicted():
    ledger = Ledger()
    ledger.add_queued(entry("a"))
    assert sums(ledger) == (40, 10, 0, 1)
    assert ledger.apply(ProgressEvent("a", "evicted"))
    assert sums(ledger) == (100, 10, 0, 1)
    ledger.apply(ProgressEvent("a", "evicted", 32))  # 32 tokens of prefix are still reusable
    assert sums(ledger) == (68, 10, 0, 1)


def test_eviction_report_for_an_active_request_changes_nothing():
    ledger = Ledger()
    ledger.add_queued(entry("a"))
    ledger.apply(ProgressEvent("a", "admitted"))
    ledger.apply(ProgressEvent("a", "evicted"))
    assert sums(ledger) == (40, 10, 1, 0)


def test_progress_reports_update_the_sums():
    ledger = Ledger()
    ledger.add_queued(entry("a"))
    ledger.add_queued(entry("b", prompt=50, cached=0, max_tokens=5))
    ledger.apply(ProgressEvent("a", "admitted"))
    assert sums(ledger) == (90, 15, 1, 1)
    ledger.apply(ProgressEvent("a", "prefill", 80))  # 60 cached + 20 computed: 20 left
    assert sums(ledger) == (70, 15, 1, 1)
    ledger.apply(ProgressEvent("a", "generated", 3))  # prompt done, 7 budget left
    assert sums(ledger) == (50, 12, 1, 1)
    assert sums(ledger) == brute_force_sums(ledger)


def test_prefill_report_corrects_a_stale_estimate():
    ledger = Ledger()
    ledger.add_queued(entry("a", prompt=100, cached=90))  # estimated 10 to compute
    ledger.apply(ProgressEvent("a", "prefill", 30))  # the backend found only 30 cached
    assert ledger.num_prefill_tokens == 70


def test_late_duplicate_and_reordered_reports_are_idempotent():
    ledger = Ledger()
    ledger.add_queued(entry("a"))
    ledger.apply(ProgressEvent("a", "generated", 5))
    ledger.apply(ProgressEvent("a", "generated", 5))
    ledger.apply(ProgressEvent("a", "generated", 2))  # late report of an earlier count
    ledger.apply(ProgressEvent("a", "admitted"))  # late admission after progress
    ledger.apply(ProgressEvent("a", "prefill", 10))  # late prefill report after tokens
    assert sums(ledger) == (0, 5, 1, 0)
    assert sums(ledger) == brute_force_sums(ledger)


def test_progress_implies_admission():
    ledger = Ledger()
    ledger.add_queued(entry("a"))
    ledger.apply(ProgressEvent("a", "generated", 1))
    assert (ledger.num_active, ledger.num_queued) == (1, 0)


def test_unknown_request_is_ignored_and_finish_removes():
    ledger = Ledger()
    ledger.add_queued(entry("a"))
    assert not ledger.apply(ProgressEvent("zzz", "generated", 3))
    assert ledger.apply(ProgressEvent("a", "finished"))
    assert sums(ledger) == (0, 0, 0, 0) and len(ledger) == 0
    assert not ledger.apply(ProgressEvent("a", "generated", 9))  # late report after finish


def test_aborted_active_request_leaves_the_sums():
    ledger = Ledger()
    ledger.add_queued(entry("a"))
    ledger.add_queued(entry("b"))
    ledger.apply(ProgressEvent("a", "generated", 4))
    ledger.apply(ProgressEvent("a", "aborted"))
    assert sums(ledger) == (40, 10, 0, 1)


def test_budget_overrun_counts_zero_not_negative():
    ledger = Ledger()
    ledger.add_queued(entry("a", max_tokens=10))
    ledger.apply(ProgressEvent("a", "generated", 12))
    assert ledger.num_decode_tokens == 0
