"""Small arithmetic the whole project shares."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up, for non-negative a and positive b (e.g. blocks needed for a tokens)."""
    return -(-a // b)
