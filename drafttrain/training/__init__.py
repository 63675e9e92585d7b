"""Training: target features, the accelerate/DeepSpeed loop, checkpoints and metrics (``drafttrain train``).

Import the pieces from their modules (``drafttrain.training.trainer.Trainer``); this package stays cheap to import.
"""
