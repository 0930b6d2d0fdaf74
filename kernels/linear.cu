// linear.cu (being written)
