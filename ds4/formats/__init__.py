"""Model files, pure file work below the engine: GGUF read/write (gguf), antirez/ds4 <-> llama.cpp layouts
(layouts), Hugging Face conversion (convert), tensor-type mixes (quant_mix) and the vocabulary's GGUF keys
(vocab). Imports ops, models.args and ds4.errors only."""
