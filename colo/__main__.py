from .cli.entry import command

command()
