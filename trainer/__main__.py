"""``python -m trainer`` (what the DeepSpeed launcher and torchrun start in each process)."""

from trainer.main import main

main()
