"""The cpu backend's meter, applied to a real `trl <command> --config FILE` process (tests/test_run_as_written.py).

Python imports `sitecustomize` at startup from the first directory of sys.path that has one: the test puts this
directory on PYTHONPATH and runs the `trl` executable itself, with nothing but `--max_steps` added to the command
line. With $ADVISOR_TRL_PEAK set, the run is measured exactly as the cpu backend measures its probe
(advisor/probing/worker.py): torch.profiler's CPU allocator events (advisor.probing.meters.memory_profiler) from
just before TRL's trainer is constructed (the constructor loads the model and, for DPO and KTO, the reference model)
to the end of `train()`, replayed by `meters.cpu_peak`; the peak is written to $ADVISOR_TRL_PEAK as JSON. Nothing of
trl's own code path changes: the trainers' `__init__` and transformers' `Trainer.train` are wrapped, not replaced.
"""

import os


def _install(out: str) -> None:
    import functools
    import json

    import transformers
    import trl

    from advisor.probing import meters

    state: dict = {}

    def start(init):
        @functools.wraps(init)
        def wrapped(self, *args, **kwargs):
            if "prof" not in state:
                state["prof"] = meters.memory_profiler()
            return init(self, *args, **kwargs)

        return wrapped

    for name in ("SFTTrainer", "DPOTrainer", "RewardTrainer", "KTOTrainer"):
        cls = getattr(trl, name)
        cls.__init__ = start(cls.__init__)

    train = transformers.Trainer.train

    @functools.wraps(train)
    def measured_train(self, *args, **kwargs):
        result = train(self, *args, **kwargs)
        prof = state.pop("prof", None)
        if prof is not None:
            prof.__exit__(None, None, None)
            found = meters.cpu_peak(prof)
            with open(out, "w") as fh:
                json.dump({"peak_bytes": found.peak_bytes, "events": found.events,
                           "trainer": type(self).__name__, "steps": self.state.global_step}, fh)
        return result

    transformers.Trainer.train = measured_train


if os.environ.get("ADVISOR_TRL_PEAK"):
    _install(os.environ["ADVISOR_TRL_PEAK"])
