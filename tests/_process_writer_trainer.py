"""Run by tests/test_process_writer.py as a trainer that the test kills with SIGKILL: it saves once through a
ProcessStager (the writer process starts), prints the writer's pid (with ``fork``: forks
a child that sleeps, as a DataLoader worker would, and prints its pid), then on a line from stdin starts a second
save, waits until the job was handed to the (stopped) writer,
prints ``saving`` and sleeps until killed."""

from __future__ import annotations

import os
import sys
import time

import torch

from ckpt.saving.checkpointer import Checkpointer
from ckpt.saving.options import SaveOptions
from ckpt.saving.process_writer import ProcessStager

NO_RNG = SaveOptions(rng=False)


def main(root: str, fork: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)  # 48 MiB with Adam: the write outlasts the kill
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    ck = Checkpointer(async_save=True, stager=ProcessStager())
    ck.save(f"{root}/step1", step=1, model=model, optimizer=opt, options=NO_RNG).result()
    print(ck.stager.writer_pid, flush=True)
    if fork:  # a fork-started DataLoader worker: it outlives a SIGKILLed trainer and must not keep the writer
        child = os.fork()
        if child == 0:
            time.sleep(120)
            os._exit(0)
        print(child, flush=True)
    sys.stdin.readline()
    ck.save(f"{root}/step2", step=2, model=model, optimizer=opt, options=NO_RNG)
    ck.staged()
    time.sleep(1.0)  # the writer thread hands the job over (one line into the pipe) once the copy is done
    print("saving", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["fork"])
