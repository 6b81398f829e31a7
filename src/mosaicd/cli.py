def main() -> None:
    raise SystemExit("mosaicd: not yet")
