"""What the tests share (tests/ is on pytest's pythonpath): ``support.commands`` (running the
commands as a user would, the checkout's paths), ``support.corpora`` (the toy corpora),
``support.models`` (models built in-process), ``support.checkpoints`` (checkpoints and the tiny
training); the helper scripts the tests start (ddp_worker.py, hang_while_saving_checkpoint_last.py).
Fixtures stay in tests/conftest.py."""
