"""One set-up for both drivers (mpilb.run.session): the serial trainer is built on the
parameter server's Session, and every checkpoint of a run goes through its one writer."""

import json

import h5py

from mpilb.config.build import build_config
from mpilb.data.dataset import open_dataset
from mpilb.run.serial import SerialTrainer
from mpilb.run.session import Session


def _trainer(digits_dir, tmp_path, **options):
    cfg = build_config(cli_values={"data": digits_dir, "model": "softmax", "epochs": 2,
                                   "progress": False, "log": str(tmp_path / "run.h5"),
                                   "checkpoint": str(tmp_path / "run.ckpt.h5"), **options})
    return SerialTrainer(cfg, open_dataset(digits_dir), {"run_id": "r1", "world_size": 1})


def test_the_serial_trainer_shares_the_session_and_its_checkpoint_writer(digits_dir, tmp_path,
                                                                         monkeypatch):
    written = []
    real = Session.write_checkpoint

    def spy(self, params, version, epoch, train_s, path=None, best=None):
        written.append((path, version, best is not None))
        real(self, params, version, epoch, train_s, path=path, best=best)

    monkeypatch.setattr(Session, "write_checkpoint", spy)
    trainer = _trainer(digits_dir, tmp_path, save_best=True)
    assert isinstance(trainer.session, Session)
    assert (trainer.model, trainer.optimizer, trainer.log) == (
        trainer.session.model, trainer.session.optimizer, trainer.session.log)
    status = trainer.run()
    summary = trainer.finish(status)
    assert status == "finished" and summary["epochs_completed"] == 2
    # the final checkpoint (path None: --checkpoint) and at least one --save-best one
    assert (None, summary["updates"], False) in written
    assert any(best for _, _, best in written)
    with h5py.File(tmp_path / "run.ckpt.h5", "r") as f:
        assert f.attrs["version"] == summary["updates"] and f.attrs["run_id"] == "r1"
    with h5py.File(tmp_path / "run.h5", "r") as f:
        attrs = dict(f.attrs)
        assert json.loads(attrs["lost_workers"]) == [] and attrs["stop_reason"] == "epochs"
        assert "stray_samples" not in attrs   # (the server's own attribute)


def test_a_serial_resume_continues_from_the_shared_writers_checkpoint(digits_dir, tmp_path):
    first = _trainer(digits_dir, tmp_path, epochs=1)
    first.finish(first.run())
    again = _trainer(digits_dir, tmp_path, epochs=2, resume=True)
    assert again.resumed is again.session.resumed and again.version == again.resumed.version > 0
    summary = again.finish(again.run())
    assert summary["epochs_completed"] == 2 and summary["coverage"]["missing"] == 0


def test_a_log_failure_on_an_epochs_last_update_keeps_that_epoch_in_the_checkpoint(
        digits_dir, tmp_path, monkeypatch):
    """The log fails on the update that applies an epoch's last samples, before the epoch is
    ended: the rescue checkpoint says the next epoch comes next, so it must also record this
    one as completed. It used to skip it: the resumed run ended with one epoch's row and
    coverage missing (the fresh-clone CI saw 99 of 100 epochs in
    test_a_full_log_disk_still_checkpoints_and_the_run_resumes)."""
    from mpilb.errors import LogWriteError
    from mpilb.runfiles.runlog import RunLog

    trainer = _trainer(digits_dir, tmp_path, epochs=3)
    real = RunLog.append

    def full_disk(self, group, **row):
        tr = trainer.tracker
        if group == "updates" and tr.epoch == 1 and tr.complete:
            raise LogWriteError(self.path, OSError(28, "No space left on device"))
        real(self, group, **row)

    monkeypatch.setattr(RunLog, "append", full_disk)
    try:
        trainer.run()
    except LogWriteError:
        trainer.reader.close()
        trainer.session.rescue_checkpoint(trainer._save_checkpoint)
    else:
        raise AssertionError("the log never failed")
    with h5py.File(tmp_path / "run.ckpt.h5", "r") as f:
        assert f.attrs["epoch"] == 2
        completed = [e["epoch"] for e in json.loads(f["coverage"].attrs["completed"])]
    assert completed == [0, 1]
    trainer.log.release()
    monkeypatch.setattr(RunLog, "append", real)
    again = _trainer(digits_dir, tmp_path, epochs=3, resume=True)
    summary = again.finish(again.run())
    assert summary["epochs_completed"] == 3 and summary["coverage"]["missing"] == 0
