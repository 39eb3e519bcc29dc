"""Torture helpers shared by ``tests/test_torture_*.py`` and the ``bench/torture_*.py`` scripts.

* :mod:`torture.trainer`: a tiny training process that checkpoints asynchronously and logs what it saved;
* :mod:`torture.crash`: SIGKILLs that process at random moments and checks every restart;
* :mod:`torture.s3`: a moto S3 server on 127.0.0.1 for scripts that run outside pytest;
* :mod:`torture.faultproxy`: a loopback HTTP proxy that injects S3 faults between s3fs and moto.

Import as ``torture.<module>`` with ``tests/`` on ``sys.path`` (pytest puts it there; the bench scripts add it).
"""
