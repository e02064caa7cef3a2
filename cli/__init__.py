"""Click commands only: parse, validate, call one library function, print."""
