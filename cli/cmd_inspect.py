"""placeholder"""
def add_parser(subparsers):
    p = subparsers.add_parser("inspect", help="inspect")
    p.set_defaults(run=lambda a: 0)
