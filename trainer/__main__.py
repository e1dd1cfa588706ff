"""``python -m sandpiper.trainer`` (what the DeepSpeed launcher and torchrun start in each process)."""

from sandpiper.trainer.main import main

main()
