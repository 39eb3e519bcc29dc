"""Resume verification: the run ledger, log readers (:mod:`.sources`), continuity checks (:mod:`.checks`), the
verifier (:mod:`.verify`), run comparison (:mod:`.compare`) and the recovery-cost report (:mod:`.cost`).

Spec of the run directory: docs/run-dir.md; how verdicts are reached: docs/verify-resume.md.
"""
