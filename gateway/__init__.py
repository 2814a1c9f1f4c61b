"""``spotdrain gateway``: an OpenAI-compatible streaming proxy that continues a broken stream on another replica."""
