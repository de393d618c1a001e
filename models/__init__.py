"""Eager DeepSeek V4 Flash model and MTP head, written only against registry ops."""
