"""The release whose API this stand-in follows (the real tensorrt_llm/version.py holds __version__)."""

__version__ = "1.2.1+standin"
