"""tokenmill: train GPT-style models close to the hardware limit.

Every speed and memory technique is a documented config switch (see ``tokenmill.config``), applied
in one place, tested to keep the math, and measured by ``tokenmill bench``.
"""

__version__ = "0.1.0"
