"""How a library's error is quoted inside a one-line refusal."""


def one_line(err: Exception) -> str:
    """``Type: first line of the message``: library errors can run to many lines."""
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
