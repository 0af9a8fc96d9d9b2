"""ftc, the FreeToken compiler: turns a Mixture-of-Experts model into an engine for one machine."""

__version__ = "0.1.0"
