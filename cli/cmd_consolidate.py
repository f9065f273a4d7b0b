"""placeholder"""
def add_parser(subparsers):
    p = subparsers.add_parser("consolidate", help="consolidate")
    p.set_defaults(run=lambda a: 0)
