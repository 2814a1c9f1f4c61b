"""Where notices come from: the IMDS poller, the SQS consumer and its AWS calls, message parsing, the Notice."""
