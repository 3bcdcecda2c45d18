"""Language modelling (decoder-only, MicroNet): data, loss, perplexity and the LanguageModel."""
