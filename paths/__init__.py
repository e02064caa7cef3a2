"""paths: train mixture-of-experts language models as small dense paths (DiPaCo / HDEE / BTX)."""

__version__ = "0.1.0"
