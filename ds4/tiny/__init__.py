"""Models the project makes itself: tiny random GGUFs (build), their vocabulary (vocab), full-shape random
models built on a device (random_model), tiny transformers checkpoints (hf) and the embedded default model
(default_model/, trained by scripts/train_tiny.py). Imports the formats, models, backends and ops below it."""
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
