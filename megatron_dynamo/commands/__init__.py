"""One module per `dynamo` subcommand: add_arguments(parser) and main(args) -> exit code."""
