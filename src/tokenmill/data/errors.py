"""The one exception type of the data package."""


class DataError(ValueError):
    """Bad or missing data. The message names the file, the problem and the fix."""
